"""What the framework tests share: running the user's scripts as users run them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import amp_runtime

HERE = Path(__file__).resolve().parent
#: No download, no telemetry, no progress bars from the frameworks.
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "DISABLE_MLFLOW_INTEGRATION": "TRUE", "TOKENIZERS_PARALLELISM": "false"}


def line_of(script: Path, marker: str) -> tuple:
    """``(script, line)`` of the line holding ``marker`` (where the guard must point)."""
    for number, text in enumerate(script.read_text(encoding="utf-8").splitlines(), 1):
        if marker in text:
            return script, number
    raise AssertionError(f"{marker!r} not in {script}")


def place(source: str) -> tuple:
    """An event's ``file:line`` as ``(absolute path, line)`` (sources below the working
    folder are relative)."""
    path, _, line = source.rpartition(":")
    return Path(path).resolve(), int(line)


def run_script(script: Path, args, tmp_path: Path, guard_out: Path = None, timeout=300):
    """Run ``script`` as ``python SCRIPT ARGS`` or, with ``guard_out``, as ``python -m
    amp_runtime run --out GUARD_OUT SCRIPT ARGS``; (exit status, losses, output)."""
    losses = tmp_path / f"losses-{len(list(tmp_path.iterdir()))}.json"
    runner = [] if guard_out is None else ["-m", "amp_runtime", "run", "--out", str(guard_out)]
    result = subprocess.run(
        [sys.executable, *runner, str(script), *map(str, args), "--losses", str(losses)],
        cwd=tmp_path, env={**os.environ, **ENV}, capture_output=True, text=True,
        timeout=timeout)
    output = result.stdout + result.stderr
    values = json.loads(losses.read_text()) if losses.exists() else None
    return result.returncode, values, output


def events_in(log_dir: Path):
    return list(amp_runtime.Report.from_jsonl(log_dir / "events.jsonl"))


def assert_sources_are_users(events, script: Path):
    """Every event points at the user's script; a framework's line goes only in details."""
    for event in events:
        assert event.source and place(event.source)[0] == script, str(event)


def assert_overflow_pinned(events, script: Path, overflow: tuple, step: int):
    """The first event is AMP101 at the injected line and step, none came earlier, and every
    event points at the user's script."""
    first = events[0]
    assert (first.code, first.step, place(first.source)) == ("AMP101", step, overflow)
    assert min(e.step for e in events) == step
    assert_sources_are_users(events, script)


def rebuilt_report(log_dir: Path) -> str:
    """``python -m amp_runtime report LOG_DIR``, as a user runs it; the page's text."""
    result = subprocess.run([sys.executable, "-m", "amp_runtime", "report", str(log_dir)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return (log_dir / "report.html").read_text(encoding="utf-8")


def torchrun(*args, cwd: Path):
    """``torchrun --standalone --nproc-per-node 2 ARGS``: a 2-process gloo group on the CPU."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"})
