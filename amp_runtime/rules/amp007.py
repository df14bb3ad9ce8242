"""AMP007 fp16-overflow-literal: a fill or constant beyond ±65504 meets an fp16 tensor.

Checked before the op: on the CPU ``masked_fill(mask, -1e9)`` on fp16 raises ("value
cannot be converted ... without overflow"), elsewhere the value silently becomes inf.
Infinite values are deliberate (``float("-inf")`` masks) and are not flagged. A tensor
constant is read through the guard's readings (``readings.py``), without a host sync: judged
when its copy arrives.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch

from flake8_amp.catalog import FP16_MAX

from ..monitors import Monitor, OpHandler, argument, readable

_T = torch.Tensor


def _dtype(value: Any) -> Optional[torch.dtype]:
    return value.dtype if isinstance(value, torch.Tensor) else None


def _masked_fill(args, kwargs):
    return _dtype(argument(args, kwargs, 0, "input")), argument(args, kwargs, 2, "value")


def _fill(args, kwargs):
    return _dtype(argument(args, kwargs, 0, "input")), argument(args, kwargs, 1, "value")


def _full(args, kwargs):
    return kwargs.get("dtype"), argument(args, kwargs, 1, "fill_value")


def _full_like(args, kwargs):
    dtype = kwargs.get("dtype") or _dtype(argument(args, kwargs, 0, "input"))
    return dtype, argument(args, kwargs, 1, "fill_value")


def _new_full(args, kwargs):
    dtype = kwargs.get("dtype") or _dtype(args[0] if args else None)
    return dtype, argument(args, kwargs, 2, "fill_value")


def _where(args, kwargs):
    branches = (argument(args, kwargs, 1, "input"), argument(args, kwargs, 2, "other"))
    tensors = [b for b in branches if isinstance(b, torch.Tensor) and b.dim() > 0]
    constants = [b for b in branches if not isinstance(b, torch.Tensor) or b.dim() == 0]
    if len(tensors) == 1 and len(constants) == 1:
        return tensors[0].dtype, constants[0]
    return None, None


#: torch function -> (args, kwargs) -> (dtype of the tensor written, the constant)
FILLS = {
    _T.masked_fill: _masked_fill, _T.masked_fill_: _masked_fill, torch.masked_fill: _masked_fill,
    _T.fill_: _fill, torch.fill: _fill,
    torch.full: _full, torch.full_like: _full_like, _T.new_full: _new_full,
    torch.where: _where, _T.where: lambda args, kwargs: _where((None, *args), kwargs),
}


class Fp16OverflowLiteral(Monitor):
    codes = ("AMP007",)

    def op_handlers(self):
        return {func: OpHandler(before=self._check) for func in FILLS}

    def _check(self, func, args, kwargs) -> None:
        dtype, constant = FILLS[func](args, kwargs)
        if dtype != torch.float16 or isinstance(constant, bool):
            return
        if isinstance(constant, (int, float)):
            if _overflows(constant):
                self.guard.emit("AMP007", op=func, value=f"{constant:g}",
                                details={"value": float(constant)})
        elif isinstance(constant, torch.Tensor) and constant.dim() == 0 and readable(constant):
            # a tensor constant, on any device, is read through the guard's readings
            judge = functools.partial(self._judge_tensor, func, self.guard.tracker.site())
            self.submit([constant.detach()], judge)

    def _judge_tensor(self, func, where, values, step) -> None:
        value = values[0]
        if _overflows(value):
            module, location = where
            self.guard.emit("AMP007", op=func, value=f"{value:g}", details={"value": value},
                            module=module, location=location, step=step)


def _overflows(value: float) -> bool:
    """Finite and beyond fp16's range (an infinite fill is a deliberate mask)."""
    return math.isfinite(value) and abs(value) > FP16_MAX


def monitors(guard):
    return [Fp16OverflowLiteral()]
