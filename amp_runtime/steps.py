"""Automatic step detection: where one training step ends.

* A loop with a GradScaler: at ``scaler.update()`` (reported by the scaler watch,
  ``monitors/scaler.py``). Skipped steps count: the update runs whether or not the optimizer
  stepped. An optimizer stepped directly (not by ``scaler.step``, AMP006) ends the step itself, and
  an update right after it (no backward in between) belongs to that step.
* Otherwise at ``optimizer.step()`` (global optimizer step post-hook). With several optimizers the
  step ends after the last one of the cycle, learned in the first iteration: an optimizer stepping
  for the first time right after another one (no backward in between) joins that step; one stepping
  for the first time after its own backward (e.g. a GAN's generator) makes the first iteration count
  as two steps. An optimizer stepping again before the cycle completed also ends the step.
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

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook, register_optimizer_step_pre_hook,
)

from amp_runtime.monitors import Monitor, OpHandler
from amp_runtime.monitors.scaler import BACKWARD_FUNCTIONS, watch_of


class StepDetector(Monitor):
    """Ends the guard's steps at scaler updates or optimizer steps."""

    codes = ()
    essential = True  # without step ends, per-step state would pile up

    def __init__(self):
        super().__init__()
        self._last_in_cycle: Optional[weakref.ref] = None
        self._known: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._stepped: set = set()
        self._backward_since_step = False
        self._ended_by_optimizer = False
        self._joined_ended_step = False
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

    def _end_step(self, by_optimizer: bool = False) -> None:
        self._stepped.clear()
        self._backward_since_step = False
        self._ended_by_optimizer = by_optimizer
        self.guard._end_step()

    def _backward_starts(self, func, args, kwargs):
        self._backward_since_step = True

    def _scaler_updated(self, scaler):
        if self._automatic() and (self._backward_since_step or not self._ended_by_optimizer):
            self._end_step()

    def _optimizer_step_starts(self, optimizer, args, kwargs):
        self._stepping += 1
        if self._stepping > 1:  # an optimizer subclass's step() calling super().step()
            return
        if not self._automatic() or self._watch.scaler_stepping():  # scaler.update() ends that step
            return
        if id(optimizer) in self._stepped:  # a new iteration began before the cycle completed
            self._end_step(by_optimizer=True)
        if optimizer not in self._known:
            self._known.add(optimizer)
            self._last_in_cycle = weakref.ref(optimizer)
            self._joined_ended_step = self._ended_by_optimizer and not self._backward_since_step

    def _optimizer_step_ends(self, optimizer, args, kwargs):
        self._stepping -= 1
        if self._stepping > 0 or not self._automatic() or self._watch.scaler_stepping():
            return
        self._stepped.add(id(optimizer))
        if self._last_in_cycle is None or self._last_in_cycle() is not optimizer:
            return
        if self._joined_ended_step:  # belongs to the step just ended; the cycle ends here from now
            self._joined_ended_step = False
            self._stepped.clear()
        else:
            self._end_step(by_optimizer=True)


def monitors(guard):
    return [StepDetector()]
