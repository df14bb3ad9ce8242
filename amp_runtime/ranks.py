"""Where a guard's logs go, and where each process of a distributed (DDP) run writes them:
``DIR/rank-N``.

One process writes to ``DIR`` itself; under torchrun, Lightning or Hugging Face with
several processes, each writes to ``DIR/rank-N`` (N its global rank), so that no two
processes write the same file and ``python -m amp_runtime report DIR`` finds them all.

Torch-free: the report reads these folders without torch.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional, Tuple, Union

#: The guard's log folder: ``python -m amp_runtime run``'s default ``--out``, and the folder
#: the trainer callbacks make inside the trainer's output folder.
LOG_FOLDER = "amp-report"
RANK_DIR = "rank-{}"
_RANK_DIR_NAME = re.compile(r"rank-(\d+)")


def rank_log_dir(base: Union[str, os.PathLike], rank: Optional[int], world_size: int) -> Path:
    """``base/rank-N`` when the run has several processes, else ``base``."""
    base = Path(base)
    return base / RANK_DIR.format(rank) if world_size > 1 and rank is not None else base


def report_folders(log_dir: Union[str, os.PathLike], base: Union[str, os.PathLike],
                   rank: Optional[int]) -> List[Path]:
    """The folders a finished process builds ``report.html`` in: its own log folder, and on
    rank 0 of a run with several processes also ``base``, whose page covers every rank (from
    what the others have written so far)."""
    log_dir, base = Path(log_dir), Path(base)
    return [log_dir, base] if rank == 0 and log_dir != base else [log_dir]


def launcher_rank() -> Tuple[Optional[int], int]:
    """``(rank, world size)`` from the environment torchrun (and Lightning's and
    accelerate's launchers) set for each process: ``RANK``, ``WORLD_SIZE``; ``(None, 1)``
    outside a distributed launch."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ["RANK"]) if "RANK" in os.environ else None
    except ValueError:  # not a launcher's value: treat the process as alone
        return None, 1
    return (rank, world_size) if rank is not None and world_size > 1 else (None, 1)


def rank_dirs(base: Union[str, os.PathLike]) -> List[Tuple[int, Path]]:
    """The ``rank-N`` folders directly below ``base``, as ``(N, path)`` in rank order."""
    base = Path(base)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        match = _RANK_DIR_NAME.fullmatch(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)
