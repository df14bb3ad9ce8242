"""``AmpGuardCallback`` for the Hugging Face ``Trainer``::

    from amp_runtime.integrations.transformers import AmpGuardCallback

    trainer = Trainer(model=model, args=TrainingArguments(bf16=True, ...),
                      train_dataset=data, callbacks=[AmpGuardCallback()])
    trainer.train()
"""
from __future__ import annotations

import functools
import sys

from .session import GuardSession, import_framework

_transformers = import_framework("transformers", __name__, "transformers")

#: How far up from the callback ``Trainer.__init__`` is (handler, its dispatch, the Trainer).
_TRAINER_FRAME_DEPTH = 6


class AmpGuardCallback(_transformers.TrainerCallback):
    """Runs ``trainer.train()`` inside an ``amp_runtime.guard()``.

    The guard is entered at ``on_train_begin`` and left at ``on_train_end``. The Trainer
    calls no callback when ``train()`` raises, so a callback given to ``Trainer(callbacks=
    [...])`` also wraps that trainer's ``train`` to leave the guard on an exception (a
    ``GuardError`` under ``policy="raise"`` included); one added later with
    ``trainer.add_callback`` leaves a guard that a failed ``train()`` left open at the next
    ``train()``. ``model=`` is the Trainer's model, events name ``state.global_step`` and,
    under DDP, the rank; the logs go to ``args.output_dir/amp-report`` (``rank-N`` below it
    for each process of a multi-process run) unless ``log_dir`` says otherwise.

    Arguments as ``amp_runtime.guard()`` (``policy``, ``select``, ``ignore``, ``trace``,
    ``thresholds``, ``tensorboard``, ``raise_at``), and ``log_dir`` (None: the trainer's
    folder; a path; False: no logs), ``report`` (build ``report.html`` when training ends).
    ``callback.guard`` is the guard of the training in progress, or of the last one.
    """

    def __init__(self, policy: str = "warn", select=None, ignore=None, trace: str = "auto",
                 thresholds=None, log_dir=None, report: bool = True, tensorboard=None,
                 raise_at: str = "P1"):
        self.session = GuardSession(policy, select, ignore, trace, thresholds, log_dir, report,
                                    tensorboard, raise_at)

    @property
    def guard(self):
        return self.session.guard

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _constructing_trainer(sys._getframe(1))
        if trainer is not None:
            _leave_guard_when_train_raises(trainer, self.session)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.session.start(model, args.output_dir, args.process_index, args.world_size)
        self.session.sync_step(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.session.sync_step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.session.finish()


def _constructing_trainer(frame):
    """The Trainer whose ``__init__`` is calling ``on_init_end`` (a few frames up), or None."""
    for _ in range(_TRAINER_FRAME_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


def _leave_guard_when_train_raises(trainer, session: GuardSession) -> None:
    """Wrap this trainer's ``train`` (an instance attribute) to leave the guard on an exception."""
    train = trainer.train

    @functools.wraps(train)
    def train_leaving_the_guard_on_error(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except BaseException as error:
            session.finish(error)
            raise

    trainer.train = train_leaving_the_guard_on_error


__all__ = ["AmpGuardCallback"]
