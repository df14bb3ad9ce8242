"""AMP011 tiny-epsilon: an epsilon that flushes to zero in the fp16 tensor it meets.

``x / (y + 1e-8)`` in fp16: 1e-8 is below fp16's smallest subnormal (5.96e-8) and rounds
to 0, so the guard against division by zero does nothing. Seen as an add/sub of a Python
float, or a ``clamp(min=eps)``, on an fp16 tensor. (Adam's ``eps`` over fp16 parameters is
checked at the optimizer step by the gradient monitors.)
"""
from __future__ import annotations

import torch

from flake8_amp.catalog import FP16_TINY_SUBNORMAL

from ..monitors import Monitor, OpHandler, argument

_T = torch.Tensor
ADD_FUNCTIONS = (torch.add, _T.add, _T.add_, torch.sub, _T.sub, _T.sub_)
CLAMP_FUNCTIONS = (torch.clamp, _T.clamp, _T.clamp_, torch.clamp_min, _T.clamp_min, _T.clamp_min_)


def flushes_to_zero(value) -> bool:
    """A nonzero float that rounds to 0 in fp16 (half the smallest subnormal or less)."""
    return isinstance(value, float) and value != 0 and abs(value) <= FP16_TINY_SUBNORMAL / 2


class TinyEpsilon(Monitor):
    codes = ("AMP011",)

    def op_handlers(self):
        handlers = {func: OpHandler(before=self._check_add) for func in ADD_FUNCTIONS}
        handlers.update({func: OpHandler(before=self._check_clamp) for func in CLAMP_FUNCTIONS})
        return handlers

    def _check_add(self, func, args, kwargs) -> None:
        self._check(func, argument(args, kwargs, 0, "input"), argument(args, kwargs, 1, "other"))

    def _check_clamp(self, func, args, kwargs) -> None:
        self._check(func, argument(args, kwargs, 0, "input"), argument(args, kwargs, 1, "min"))

    def _check(self, func, tensor, epsilon) -> None:
        is_fp16 = isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float16
        if is_fp16 and flushes_to_zero(epsilon):
            self.guard.emit("AMP011", op=func, value=f"{epsilon:g}")


def monitors(guard):
    return [TinyEpsilon()]
