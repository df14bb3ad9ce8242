"""AMP001 manual-cast: a module or a grad-requiring tensor cast to fp16/bf16 in training.

A cast is seen as the ``Tensor.half/bfloat16/to/type`` call that produces a
low-precision tensor from a higher-precision one. ``model.half()`` casts each parameter
inside ``Module._apply``, which turns grad mode off around the cast, so for modules the
guard judges "training code" by ``module.training`` (and not inference mode) and reports
one event per module; a plain tensor needs grad mode on and ``requires_grad``.
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from ..monitors import LOW_PRECISION, Monitor, OpHandler, dtype_name

CAST_FUNCTIONS = (torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.to, torch.Tensor.type)
_APPLY_CODE = torch.nn.Module._apply.__code__


def module_being_converted() -> Optional[torch.nn.Module]:
    """The module whose ``_apply`` (``.half()``, ``.to()``, ...) the user called, if any."""
    outermost = None
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _APPLY_CODE:
            outermost = frame.f_locals.get("self")
        frame = frame.f_back
    return outermost


class ManualCast(Monitor):
    codes = ("AMP001",)

    def attach(self, guard) -> None:
        super().attach(guard)
        self._reported: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

    def op_handlers(self):
        return {func: OpHandler(after=self._check_cast) for func in CAST_FUNCTIONS}

    def _check_cast(self, func, args, kwargs, out) -> None:
        source = args[0] if args else None
        if not (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor)):
            return
        narrowed = source.is_floating_point() and source.dtype not in LOW_PRECISION
        if out.dtype not in LOW_PRECISION or not narrowed:
            return
        if torch.is_inference_mode_enabled():
            return
        if isinstance(source, torch.nn.Parameter):
            module = module_being_converted()
            if module is None or not module.training or module in self._reported:
                return
            self._reported.add(module)
            name = self.guard.tracker.name_of(module)
            self.guard.emit("AMP001", op=func, target=f"module {name}", dtype=dtype_name(out.dtype),
                            module=name, details={"module_class": type(module).__name__})
        elif source.requires_grad and torch.is_grad_enabled():
            self.guard.emit("AMP001", op=func, target="a grad-requiring tensor",
                            dtype=dtype_name(out.dtype))


def monitors(guard):
    return [ManualCast()]
