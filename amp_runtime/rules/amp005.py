"""AMP005 clip-before-unscale, runtime half: clipping gradients a GradScaler scaled, not unscaled.

The static half is ``flake8_amp/rules/amp005.py``. Clipping is recognised by the kernels
``clip_grad_norm_`` / ``clip_grad_value_`` run (``_foreach_norm``, ``_foreach_clamp_min_`` and their
per-tensor fallbacks) when called from ``torch/nn/utils/clip_grad.py``. The gradients are scaled
when a backward started from a loss the scaler scaled and the scaler's own per-optimizer stage for
the gradients' optimizer is still READY (``unscale_`` sets it to UNSCALED).
"""
from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from amp_runtime.monitors import Monitor, OpHandler
from amp_runtime.monitors.scaler import called_from, watch_of

#: The public clipping functions, as they appear in the call stack of their kernels.
CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")
#: Kernels clipping runs first (foreach and per-tensor paths).
CLIP_KERNELS = (
    torch._foreach_norm, torch.linalg.vector_norm, torch._foreach_clamp_min_, torch.Tensor.clamp_,
)


def _tensors(args, kwargs):
    first = args[0] if args else kwargs.get("self", kwargs.get("input"))
    return list(first) if isinstance(first, (list, tuple)) else [first]


def _may_hold_scaled_grads(state) -> bool:
    """Whether a scaler may still hold some gradients scaled: an optimizer it knows is READY,
    or it knows none yet and unscaled nothing (as ``_kernel_runs`` decides, for any gradients)."""
    return (any(state.stage(opt) is OptState.READY for opt in state.optimizers)
            or OptState.UNSCALED not in state.stages())


def _owns_any(optimizer, grad_ids) -> bool:
    return any(p.grad is not None and id(p.grad) in grad_ids
               for group in optimizer.param_groups for p in group["params"])


class ClipBeforeUnscale(Monitor):
    codes = ("AMP005",)

    def __init__(self):
        super().__init__()
        self._watch = None
        self._reported_step = None

    def op_handlers(self):
        return {kernel: OpHandler(before=self._kernel_runs) for kernel in CLIP_KERNELS}

    def _kernel_runs(self, func, args, kwargs):
        if self._watch is None:
            self._watch = watch_of(self.guard)
        pending = self._watch.scaled_pending() if self._watch is not None else []
        if not pending or self._reported_step == self.guard.step_index:
            return
        if not any(map(_may_hold_scaled_grads, pending)):
            return  # the usual loop: unscale_ came first (no frame walk at every step)
        clip = called_from(CLIP_FUNCTIONS, "clip_grad.py")
        if clip is None:
            return
        grads = {id(t) for t in _tensors(args, kwargs)}
        for state in pending:
            owners = [opt for opt in state.optimizers if _owns_any(opt, grads)]
            if owners:
                scaled = any(state.stage(opt) is OptState.READY for opt in owners)
            else:  # optimizers not known yet (first step): scaled unless something was unscaled
                scaled = OptState.UNSCALED not in state.stages()
            if scaled:
                self._reported_step = self.guard.step_index
                self.guard.emit("AMP005", op=f"torch.nn.utils.{clip}", func=clip)
                return


def monitors(guard):
    return [ClipBeforeUnscale()]
