"""AMP004 low-precision-reduce: a reduction whose input and output are both fp16/bf16.

Judged by the actual output dtype, so autocast's own upcasts (``prod`` on the CPU, ``sum``
and ``norm`` on CUDA) and an explicit ``dtype=torch.float32`` are respected.
"""
from __future__ import annotations

import torch

from ..monitors import LOW_PRECISION, Monitor, OpHandler, dtype_name

_T = torch.Tensor
REDUCE_FUNCTIONS = (
    torch.sum, _T.sum, torch.mean, _T.mean, torch.cumsum, _T.cumsum, torch.cumprod, _T.cumprod,
    torch.prod, _T.prod, torch.norm, _T.norm, torch.var, _T.var, torch.std, _T.std,
    torch.nansum, _T.nansum, torch.linalg.vector_norm,
)


class LowPrecisionReduce(Monitor):
    codes = ("AMP004",)

    def op_handlers(self):
        return {func: OpHandler(after=self._check) for func in REDUCE_FUNCTIONS}

    def _check(self, func, args, kwargs, out) -> None:
        source = args[0] if args else kwargs.get("input")
        if (
            isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor)
            and source.dtype in LOW_PRECISION and out.dtype in LOW_PRECISION and source.numel() > 1
        ):
            self.guard.emit("AMP004", op=func, dtype=dtype_name(source.dtype),
                            details={"elements": source.numel()})


def monitors(guard):
    return [LowPrecisionReduce()]
