"""Automatic step detection: where one training step ends.

* A loop with a GradScaler: at ``scaler.update()`` (reported by the scaler watch,
  ``monitors/scaler.py``). Skipped steps count: the update runs whether or not the optimizer
  stepped. An optimizer stepped directly (not by ``scaler.step``, AMP006) ends the step itself, and
  an update right after it (no backward in between) belongs to that step.
* Otherwise at ``optimizer.step()`` (global optimizer step post-hook).
* Several optimizers, or several scalers (a GAN with one GradScaler per network), act in a cycle:
  the step ends after the last one of the cycle, learned in the first iteration. One acting for the
  first time right after another one (no backward in between) joins that step; one acting for the
  first time after its own backward (e.g. a GAN's generator) makes the first iteration count as two
  steps. One acting again before the cycle completed also ends the step.
* ``guard.step()`` for loops with neither; once it is called, automatic detection stays off.

An optimizer subclass whose ``step()`` calls ``super().step()`` runs the global step hooks twice,
nested: only the outer call counts.

Gradient accumulation needs nothing special: micro-batches only run backward, and steps end where
the optimizer or the scaler acts.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

from torch.optim.optimizer import (
    register_optimizer_step_post_hook, register_optimizer_step_pre_hook,
)

from amp_runtime.monitors import Monitor, OpHandler
from amp_runtime.monitors.scaler import BACKWARD_FUNCTIONS, watch_of


class _Cycle:
    """Optimizers (or scalers) that each act once per iteration: the step ends after the last
    one, learned in the first iteration (see the module doc)."""

    def __init__(self, detector: "StepDetector", kind: str):
        self.detector = detector
        self.kind = kind
        self.last: Optional[weakref.ref] = None
        self.known: weakref.WeakSet = weakref.WeakSet()
        self.acted: set = set()
        self.joined = False

    def starts(self, member) -> None:
        detector = self.detector
        if id(member) in self.acted:  # a new iteration began before the cycle completed
            detector._end_step(self.kind)
        if member not in self.known:
            self.known.add(member)
            self.last = weakref.ref(member)
            self.joined = detector._ended_by == self.kind and not detector._backward_since_step

    def ends(self, member) -> None:
        self.acted.add(id(member))
        if self.last is None or self.last() is not member:
            return
        if self.joined:  # belongs to the step just ended; the cycle ends here from now
            self.joined = False
            self.acted.clear()
        else:
            self.detector._end_step(self.kind)


class StepDetector(Monitor):
    """Ends the guard's steps at scaler updates or optimizer steps."""

    codes = ()
    essential = True  # without step ends, per-step state would pile up

    def __init__(self):
        super().__init__()
        self._optimizers = _Cycle(self, "optimizer")
        self._scalers = _Cycle(self, "scaler")
        self._backward_since_step = False
        #: What ended the last step: "optimizer", "scaler" or None.
        self._ended_by: Optional[str] = None
        #: Optimizer steps in progress: the hooks of a step() nested in another are not a step.
        self._stepping = 0

    def attach(self, guard):
        super().attach(guard)
        self.keep(register_optimizer_step_pre_hook(self._optimizer_step_starts))
        self.keep(register_optimizer_step_post_hook(self._optimizer_step_ends))
        self._watch = watch_of(guard)
        self._watch.update_listeners.append(self._scaler_updated)

    def op_handlers(self):
        return {func: OpHandler(before=self._backward_starts) for func in BACKWARD_FUNCTIONS}

    def _automatic(self) -> bool:
        guard = self.guard
        own_thread = threading.get_ident() == guard._thread
        return own_thread and not guard.manual_steps and not guard.suspended

    def _end_step(self, ended_by: Optional[str] = None) -> None:
        self._optimizers.acted.clear()
        self._scalers.acted.clear()
        self._backward_since_step = False
        self._ended_by = ended_by
        self.guard._end_step()

    def _backward_starts(self, func, args, kwargs):
        self._backward_since_step = True

    def _scaler_updated(self, scaler):
        if not self._automatic():
            return
        if self._ended_by == "optimizer" and not self._backward_since_step:
            return  # the update of the optimizer step that just ended the step (AMP006)
        self._scalers.starts(scaler)
        self._scalers.ends(scaler)

    def _optimizer_step_starts(self, optimizer, args, kwargs):
        self._stepping += 1
        if self._stepping > 1:  # an optimizer subclass's step() calling super().step()
            return
        if not self._automatic() or self._watch.scaler_stepping():  # scaler.update() ends that step
            return
        self._optimizers.starts(optimizer)

    def _optimizer_step_ends(self, optimizer, args, kwargs):
        self._stepping -= 1
        if self._stepping > 0 or not self._automatic() or self._watch.scaler_stepping():
            return
        self._optimizers.ends(optimizer)


def monitors(guard):
    return [StepDetector()]
