"""``guard(tensorboard=writer_or_dir)``: the guard's per-step numbers as TensorBoard scalars.

Written for every step once its record is complete (a step listener), under the ``amp/``
prefix: ``amp/loss``, ``amp/loss_scale``, ``amp/grad_norm``, ``amp/skipped`` (1 on a skipped
step), and the running event counts ``amp/events/total``, ``amp/events/P0`` ..
``amp/events/AMP101`` ..., of the events of that step and the ones before (an event of a
later step recorded before this step's record was complete counts from its own step on;
one of an earlier step recorded after it, from the next step written). The argument is a
``SummaryWriter`` (or anything with ``add_scalar``; the caller keeps and closes it) or a
folder, for which the guard opens and closes its own ``torch.utils.tensorboard.SummaryWriter``.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any, Dict, List

from .monitors import Monitor

#: Per-step values of the step record written as scalars.
RECORD_SCALARS = ("loss", "loss_scale", "grad_norm")
_INSTALL_HINT = (
    'guard(tensorboard=...) needs the tensorboard package: pip install "flake8-amp[tensorboard]"'
)


class TensorBoardWriter(Monitor):
    def __init__(self, target):
        super().__init__()
        is_writer = callable(getattr(target, "add_scalar", None))
        if not (isinstance(target, (str, os.PathLike)) or is_writer):
            raise TypeError(
                "guard(tensorboard=...) takes a SummaryWriter or a log folder path, "
                f"got {type(target).__name__}")
        self.target = target
        self.writer = None
        self.owns_writer = False
        self._writer_class = None
        #: Event counts written so far (``total``, per severity, per code).
        self._counted: Counter = Counter()
        #: Event counts of the steps not written yet, per step.
        self._uncounted: Dict[int, Counter] = {}
        if not is_writer:  # a missing package is a clear error when the guard is entered
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(_INSTALL_HINT) from None
            self._writer_class = SummaryWriter

    def attach(self, guard) -> None:
        super().attach(guard)
        if self._writer_class is not None:
            self.writer = self._writer_class(log_dir=os.fspath(self.target))
            self.owns_writer = True
        else:
            self.writer = self.target
        guard.step_listeners.append(self.write_step)
        guard.event_listeners.append(self._count)

    def _count(self, event) -> None:
        step = event.step if event.step is not None else self.guard.step_index
        self._uncounted.setdefault(step, Counter()).update(
            ("total", event.severity, event.code))

    def write_step(self, step: int, record: Dict[str, Any]) -> None:
        for key in RECORD_SCALARS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"amp/{key}", value, step)
        if "skipped" in record:
            self.writer.add_scalar("amp/skipped", int(bool(record["skipped"])), step)
        for counted in [s for s in self._uncounted if s <= step]:
            self._counted.update(self._uncounted.pop(counted))
        self.writer.add_scalar("amp/events/total", self._counted["total"], step)
        for key, count in sorted(self._counted.items()):
            if key != "total":
                self.writer.add_scalar(f"amp/events/{key}", count, step)

    def detach(self) -> None:
        super().detach()
        if self.guard is not None and self.write_step in self.guard.step_listeners:
            self.guard.step_listeners.remove(self.write_step)
        if self.guard is not None and self._count in self.guard.event_listeners:
            self.guard.event_listeners.remove(self._count)
        if self.writer is not None:
            if self.owns_writer:
                self.writer.close()
            elif callable(getattr(self.writer, "flush", None)):
                self.writer.flush()
        self.writer = None


def monitors(guard) -> List[Monitor]:
    """The guard's TensorBoard writer, when ``guard(tensorboard=...)`` was given."""
    target = getattr(guard, "tensorboard", None)
    return [] if target is None else [TensorBoardWriter(target)]
