"""flake8_amp never imports torch: lint in a subprocess where ``import torch`` raises."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SNIPPETS = Path(__file__).parent / "snippets"

BLOCKER = textwrap.dedent("""\
    import sys


    class _BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None


    sys.meta_path.insert(0, _BlockTorch())
    """)


def _blocked_env(tmp_path: Path) -> dict:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }


def test_blocker_really_blocks_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=_blocked_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "torch is blocked in this test" in result.stderr


def test_lints_without_torch(tmp_path):
    snippets = [SNIPPETS / f"amp00{n}.py" for n in range(1, 5)]
    result = subprocess.run(
        [sys.executable, "-m", "flake8", "--isolated", "--select=AMP", *map(str, snippets)],
        env=_blocked_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert "AMP000" not in result.stdout
    for code in ("AMP001", "AMP002", "AMP003", "AMP004"):
        assert f": {code} " in result.stdout, f"no {code} finding without torch"
    # Nothing in the lint path loaded torch either.
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, flake8_amp.plugin; "
            "assert not any(m.split('.')[0] == 'torch' for m in sys.modules)",
        ],
        env=_blocked_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr
