"""Shared fixtures: run real flake8 the way users do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import pytest

REPO = Path(__file__).resolve().parent.parent


def _flake8(
    args: Sequence[str], cwd: Path | str = REPO, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flake8", *map(str, args)],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def flake8() -> Callable[..., subprocess.CompletedProcess]:
    """``flake8(args, cwd=..., env=...)``: run ``python -m flake8`` in a subprocess."""
    return _flake8
