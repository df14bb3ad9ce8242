"""AMP008 backward-under-autocast: backward starts while autocast is on for the loss's device.

Autocast should wrap the forward pass and the loss only; backward ops already run in the
dtype their forward ops chose. A backward a framework starts inside the autocast it opened
itself is not the user's to move: Lightning runs ``training_step`` under its precision
plugin's autocast, and manual optimization must call ``self.manual_backward(loss)`` there.
"""
from __future__ import annotations

import torch

from ..monitors import Monitor, OpHandler, autocast_on, tensors_in
from ..tracking import called_through

BACKWARD_FUNCTIONS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
#: Framework methods that start the backward inside the framework's own autocast.
FRAMEWORK_BACKWARDS = frozenset({"manual_backward"})


class BackwardUnderAutocast(Monitor):
    codes = ("AMP008",)

    def op_handlers(self):
        return {func: OpHandler(before=self._check) for func in BACKWARD_FUNCTIONS}

    def _check(self, func, args, kwargs) -> None:
        roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs", ()))
        devices = {t.device.type for t in tensors_in(roots)}
        if any(autocast_on(device) for device in devices) and not called_through(
                FRAMEWORK_BACKWARDS):
            self.guard.emit("AMP008", op="backward")


def monitors(guard):
    return [BackwardUnderAutocast()]
