"""AMP003 bce-under-autocast: ``binary_cross_entropy`` called with autocast on.

CUDA autocast refuses it; CPU autocast runs it in fp32, but the same code then fails on
the GPU, and the probabilities it takes were already rounded by a low-precision sigmoid.
Checked before the call so the event comes before CUDA's own error.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..monitors import Monitor, OpHandler, autocast_on


class BceUnderAutocast(Monitor):
    codes = ("AMP003",)

    def op_handlers(self):
        return {F.binary_cross_entropy: OpHandler(before=self._check)}

    def _check(self, func, args, kwargs) -> None:
        probabilities = args[0] if args else kwargs.get("input")
        if not isinstance(probabilities, torch.Tensor):
            return
        if autocast_on(probabilities.device.type):
            self.guard.emit("AMP003", op=func, func="binary_cross_entropy")


def monitors(guard):
    return [BceUnderAutocast()]
