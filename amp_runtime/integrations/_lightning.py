"""The Lightning callback's hooks, shared by the ``lightning`` and ``pytorch_lightning``
package names (``lightning.py``, ``pytorch_lightning.py``), which differ only in the
``Callback`` class their Trainer accepts."""
from __future__ import annotations

from .session import GuardSession


class LightningGuardHooks:
    """Runs ``trainer.fit`` inside an ``amp_runtime.guard()``.

    The guard is entered at ``on_fit_start`` and left at ``on_fit_end`` or, when fit stops
    with an exception (a ``GuardError`` under ``policy="raise"`` included), at
    ``on_exception``. ``model=`` is the LightningModule, events name ``trainer.global_step``
    and, under DDP, the rank; the logs go to ``trainer.log_dir/amp-report`` (``rank-N``
    below it for each process of a multi-process run) unless ``log_dir`` says otherwise.

    Arguments as ``amp_runtime.guard()`` (``policy``, ``select``, ``ignore``, ``trace``,
    ``thresholds``, ``tensorboard``, ``raise_at``), and ``log_dir`` (None: the trainer's
    folder; a path; False: no logs), ``report`` (build ``report.html`` when fit ends).
    ``callback.guard`` is the guard of the fit in progress, or of the last one.
    """

    def __init__(self, policy: str = "warn", select=None, ignore=None, trace: str = "auto",
                 thresholds=None, log_dir=None, report: bool = True, tensorboard=None,
                 raise_at: str = "P1"):
        super().__init__()
        self.session = GuardSession(policy, select, ignore, trace, thresholds, log_dir, report,
                                    tensorboard, raise_at)

    @property
    def guard(self):
        return self.session.guard

    def on_fit_start(self, trainer, pl_module) -> None:
        folder = trainer.log_dir or trainer.default_root_dir  # (log_dir: a collective under DDP)
        self.session.start(pl_module, folder, trainer.global_rank, trainer.world_size)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.session.sync_step(trainer.global_step)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.session.finish()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.session.finish(exception)

    def teardown(self, trainer, pl_module, stage) -> None:
        self.session.finish()  # a no-op unless fit ended without on_fit_end
