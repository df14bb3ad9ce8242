"""AMP006 step-bypasses-scaler, runtime half: an optimizer steps on scaled gradients; a scaler steps
without an update.

The static half is ``flake8_amp/rules/amp006.py``. Both cases are read from the scaler's own state:

* a global optimizer step pre-hook sees an optimizer step, not called by ``GradScaler.step``, while
  a backward from a scaled loss is pending: an inf/NaN step is not skipped, and where the scaler's
  stage for that optimizer is READY (not UNSCALED) its gradients are still multiplied by the scale.
  An optimizer the scaler never saw counts where a scaled backward wrote its gradients (a GAN's
  generator stepped directly after ``scaler.step(d_optimizer)``), not where an unscaled one did (a
  second model trained in fp32 beside the scaled one): each backward compares one gradient of each
  optimizer that stepped before and after it runs (host-side identity and version, no sync);
  in the first step, before that works, the scaled backwards' graphs are searched for the
  parameters they reach;
* a backward from a scaled loss starts while that scaler still holds a STEPPED optimizer whose
  gradients were reset since (``zero_grad``): a new iteration began, so the previous ``scaler.step``
  was not followed by ``scaler.update()`` and the scale never adapts. A backward between the steps
  of one iteration (a GAN's generator after ``scaler.step(d_optimizer)``, before the one
  ``update()``) leaves the stepped optimizer's gradients as they were and is fine.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook

from amp_runtime.monitors import Monitor, OpHandler, autograd_nodes
from amp_runtime.monitors.scaler import BACKWARD_FUNCTIONS, backward_root, watch_of


#: Autograd nodes searched per scaled backward before the first optimizer step.
FIRST_SEARCH_NODES = 20000


class StepBypassesScaler(Monitor):
    codes = ("AMP006",)

    def __init__(self):
        super().__init__()
        #: What was reported in the step ``_reported_step`` (kept for that step only).
        self._reported = set()
        self._reported_step = None
        self._watch = None
        #: Optimizer -> (weakref to a param, its ``_gradient_mark``) when the scaler stepped it.
        self._stepped_grads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        #: Optimizer -> weakref to a parameter that had a gradient when it last stepped.
        self._probes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        #: Optimizer -> whether the backward that last wrote its gradients was a scaled one.
        self._written_by_scaled: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        #: While a backward runs: (whether it is scaled, [(optimizer, gradient mark)]).
        self._running_backward = None
        #: In the first step: ids of the parameters the scaled backwards reach, and whether the
        #: searches saw their whole graphs.
        self._first_step = True
        self._first_scaled_params = set()
        self._first_search_complete = True

    @property
    def watch(self):
        """The guard's ScalerWatch (attached after this monitor: looked up at first use)."""
        if self._watch is None:
            self._watch = watch_of(self.guard)
        return self._watch

    def attach(self, guard):
        super().attach(guard)
        self.keep(register_optimizer_step_pre_hook(self._optimizer_step_starts))

    def op_handlers(self):
        return {func: OpHandler(before=self._backward_starts, after=self._backward_ends)
                for func in BACKWARD_FUNCTIONS}

    def _once_per_step(self, kind: str) -> bool:
        if self._reported_step != self.guard.step_index:
            self._reported_step, self._reported = self.guard.step_index, set()
        if kind in self._reported:
            return False
        self._reported.add(kind)
        return True

    def _optimizer_step_starts(self, optimizer, args, kwargs):
        guard = self.guard
        if guard.suspended or threading.get_ident() != guard._thread:
            return
        self._probe(optimizer)
        pending = self.watch.scaled_pending()
        if pending and self.watch.scaler_stepping():
            self._remember_grads(optimizer)
            return
        name = type(optimizer).__name__
        for state in pending:
            stage = state.stage(optimizer)
            known = optimizer in state.optimizers or self._scaled_gradients(optimizer, state)
            if stage is OptState.READY and known:
                detail = (f"{name}.step() runs on gradients GradScaler scaled and did not unscale; "
                          "steps with inf/NaN gradients are not skipped")
            elif stage is OptState.UNSCALED:
                detail = (f"{name}.step() is called directly after scaler.unscale_(); only "
                          "scaler.step() skips steps with inf/NaN gradients")
            else:
                continue
            if self._once_per_step("step"):
                guard.emit("AMP006", op=f"{name}.step", detail=detail)
            return
        if not pending and self._scaled_and_never_unscaled(optimizer):
            if self._once_per_step("step"):
                guard.emit("AMP006", op=f"{name}.step", detail=(
                    f"{name}.step() runs on gradients a scaled backward wrote, after "
                    "scaler.update(): they are still multiplied by the loss scale, and steps "
                    "with inf/NaN gradients are not skipped"))

    def _scaled_and_never_unscaled(self, optimizer) -> bool:
        """Whether a scaled backward wrote ``optimizer``'s gradients and no scaler ever unscaled
        them: it steps after the update (task weights stepped every few iterations with a
        plain ``weight_opt.step()`` after ``scaler.update()``)."""
        if any(optimizer in state.optimizers for state in self.watch.states.values()):
            return False
        return bool(self._written_by_scaled_backward(optimizer))

    def on_step_end(self, step, record):
        # marks are per step: a step the scaler skipped never ran optimizer.step to renew one
        self._stepped_grads.clear()
        self._first_step = False

    def _remember_grads(self, optimizer):
        """Mark the gradients the scaler steps on, to tell later whether they were reset."""
        param = _param_with_grad(optimizer)
        if param is not None:
            self._stepped_grads[optimizer] = (weakref.ref(param), _gradient_mark(param))

    def _grads_reset(self, optimizer) -> bool:
        """Whether ``optimizer``'s gradients were set to None or zeroed since its scaler step."""
        remembered = self._stepped_grads.get(optimizer)
        if remembered is None:
            return False
        param_ref, mark = remembered
        param = param_ref()
        return param is not None and _written_since(param, mark)

    def _scaled_gradients(self, optimizer, state) -> bool:
        """Whether a scaled backward wrote the gradients of ``optimizer``, which ``state``'s
        scaler never saw; where unknown, whether the scaler has seen no optimizer yet."""
        written = self._written_by_scaled_backward(optimizer)
        return not state.optimizers if written is None else written

    def _written_by_scaled_backward(self, optimizer) -> Optional[bool]:
        """Whether the backward that last wrote ``optimizer``'s gradients was a scaled one
        (watched across backwards once it has stepped; in the first step, whether the scaled
        backwards' graphs reach its parameters); None where unknown."""
        if optimizer in self._written_by_scaled:
            return self._written_by_scaled[optimizer]
        if self._first_scaled_params:
            params = (p for group in optimizer.param_groups for p in group["params"])
            if any(id(p) in self._first_scaled_params for p in params):
                return True
            if self._first_search_complete:
                return False
        return None

    def _search_first_scaled(self, root):
        searched = 0
        for node in autograd_nodes([root.grad_fn], FIRST_SEARCH_NODES):
            searched += 1
            variable = getattr(node, "variable", None)  # an AccumulateGrad's parameter
            if variable is not None:
                self._first_scaled_params.add(id(variable))
        if searched >= FIRST_SEARCH_NODES:
            self._first_search_complete = False

    def _probe(self, optimizer):
        """Remember a parameter of ``optimizer`` that has a gradient, to watch across backwards."""
        probe = self._probes.get(optimizer)
        if probe is not None and probe() is not None and probe().grad is not None:
            return
        param = _param_with_grad(optimizer)
        if param is not None:
            self._probes[optimizer] = weakref.ref(param)

    def _gradient_marks(self):
        marks = []
        for optimizer, probe in list(self._probes.items()):
            param = probe()
            if param is not None:
                marks.append((optimizer, param, _gradient_mark(param)))
        return marks

    def _backward_ends(self, func, args, kwargs, out):
        running, self._running_backward = self._running_backward, None
        if running is None:
            return
        scaled, marks = running
        for optimizer, param, mark in marks:
            if _written_since(param, mark):
                self._written_by_scaled[optimizer] = scaled

    def _backward_starts(self, func, args, kwargs):
        root = backward_root(func, args, kwargs)
        state = None if root is None else self.watch.scaler_of_loss(root)
        self._running_backward = (state is not None, self._gradient_marks())
        if state is not None and self._first_step:
            self._search_first_scaled(root)
        stepped = state is not None and any(
            state.stage(optimizer) is OptState.STEPPED and self._grads_reset(optimizer)
            for optimizer in state.optimizers)
        if stepped and self._once_per_step("update"):
            self.guard.emit("AMP006", op="GradScaler.step", detail=(
                "scaler.step() was not followed by scaler.update() before this backward; "
                "the loss scale never adapts"))


def _param_with_grad(optimizer):
    """A parameter of ``optimizer`` that has a gradient, or None."""
    return next((p for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None), None)


def _gradient_mark(param):
    """What tells later whether ``param``'s gradient was written: the tensor (a weak reference:
    a new one after ``zero_grad(set_to_none=True)``) and its version (bumped in place by
    accumulation and by ``zero_grad(set_to_none=False)``)."""
    grad = param.grad
    return (None, 0) if grad is None else (weakref.ref(grad), grad._version)


def _written_since(param, mark) -> bool:
    """Whether ``param``'s gradient changed since ``_gradient_mark`` took ``mark``."""
    grad_ref, version = mark
    grad = param.grad
    if grad_ref is None:
        return grad is not None
    return grad is None or grad is not grad_ref() or grad._version != version


def monitors(guard):
    return [StepBypassesScaler()]
