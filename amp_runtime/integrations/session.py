"""One guard spanning a framework's ``fit``/``train``, opened and closed by its callback.

The callbacks differ only in where the framework keeps the model, the output folder, the
rank and the step count; what the guard does with them is here, once.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Union

import torch

from ..guard import Guard
from ..html_report import ReportError, build_report
from ..ranks import LOG_FOLDER, rank_log_dir, report_folders
from ..thresholds import Thresholds

LogDir = Union[str, os.PathLike, None, bool]


def import_framework(module: str, integration: str, install: str):
    """Import the framework's ``module``, or ImportError saying what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{integration} needs {module.split('.')[0]}, which is not installed "
            f"({err}): pip install {install}") from err


class GuardSession:
    """The guard options of a callback, and the guard of the training run in progress.

    ``log_dir``: None writes the logs to the trainer's folder (``FOLDER/amp-report``),
    a path writes them there, False writes none. With several processes each writes to
    ``rank-N`` below it (``ranks.py``); rank 0 also builds the page over all ranks.
    ``report``: build ``report.html`` when training ends.
    """

    def __init__(self, policy: str = "warn", select=None, ignore=None, trace: str = "auto",
                 thresholds: Optional[Thresholds] = None, log_dir: LogDir = None,
                 report: bool = True, tensorboard=None, raise_at: str = "P1"):
        self.options = dict(policy=policy, select=select, ignore=ignore, trace=trace,
                            thresholds=thresholds, tensorboard=tensorboard, raise_at=raise_at)
        if not (log_dir is None or log_dir is False or isinstance(log_dir, (str, os.PathLike))):
            raise TypeError(f"log_dir= takes a folder path, None (the trainer's folder) or "
                            f"False (no logs), got {type(log_dir).__name__}")
        Guard(**self.options)  # a bad option fails where the callback is made, not mid-run
        self._log_dir = log_dir
        self._report = report
        #: The guard of the run in progress, or of the last run once it ended.
        self.guard: Optional[Guard] = None
        #: Where this process's guard writes its logs (None: nowhere).
        self.log_dir: Optional[Path] = None
        self._base: Optional[Path] = None
        #: This process's rank when the run has several, else None.
        self._rank: Optional[int] = None
        self._active = False

    def start(self, model: Optional[torch.nn.Module], trainer_dir: Union[str, os.PathLike, None],
              rank: Optional[int], world_size: int) -> None:
        """Enter a new guard: training starts (a guard left open by a failed run is closed)."""
        self.finish()
        if self._log_dir is None:
            base = None if trainer_dir is None else Path(trainer_dir) / LOG_FOLDER
        else:
            base = Path(self._log_dir) if self._log_dir is not False else None
        self._base, self._rank = base, (rank if world_size > 1 else None)
        self.log_dir = None if base is None else rank_log_dir(base, rank, world_size)
        self.guard = Guard(**self.options, model=model, log_dir=self.log_dir)
        self.guard.__enter__()
        self._active = True

    def sync_step(self, step: int) -> None:
        """Name events by the trainer's step count (it starts above 0 on a resumed run).
        At the start of a step; the guard counts the same steps, so this is mostly a no-op."""
        if self._active and self.guard.step_index != step:
            self.guard.number_step(step)

    def finish(self, error: Optional[BaseException] = None) -> None:
        """Leave the guard (``error``: training stopped by it), then write the report."""
        if not self._active:
            return
        self._active = False
        guard = self.guard
        try:
            guard.__exit__(type(error) if error else None, error,
                           error.__traceback__ if error else None)
        finally:
            self._write_report()

    def _write_report(self) -> None:
        """report.html of this process, and on rank 0 the page over all ranks; a summary
        of the events on stderr. A healthy run prints nothing."""
        pages = []
        if self._report and self.log_dir is not None:
            for folder in report_folders(self.log_dir, self._base, self._rank):
                try:
                    pages.append(build_report(folder))
                except ReportError as err:
                    warnings.warn(f"amp_runtime: no report: {err}", stacklevel=2)
                except Exception as err:  # training is over: a report bug must not fail it
                    warnings.warn(f"amp_runtime: no report ({type(err).__name__}: {err})",
                                  stacklevel=2)
        events = self.guard.report
        if len(events):
            rank = "" if self._rank is None else f" (rank {self._rank})"
            print(f"amp_runtime{rank}:\n{events.summary()}", file=sys.stderr)
            for page in pages:
                print(f"amp_runtime{rank}: report at {page}", file=sys.stderr)
