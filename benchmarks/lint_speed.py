"""How much does flake8-amp add to a default flake8 run? CPU seconds, side by side.

    python benchmarks/lint_speed.py            # torch/nn, torch/optim, torch/utils
    python benchmarks/lint_speed.py --repeat 5 path/to/src other/src

Both runs are the same flake8 (default checks, ``--isolated``, ``--jobs=1``) over the same
files in fresh processes; the only difference is whether flake8's plugin discovery sees
the flake8-amp distribution. CPU seconds of each child process come from
``resource.getrusage(RUSAGE_CHILDREN)``; the best of ``--repeat`` runs is reported (the
least disturbed by other load), followed by a markdown table with the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

#: Runs flake8 with the flake8-amp distribution hidden from plugin discovery.
_WITHOUT_PLUGIN = """\
import importlib.metadata as metadata
import sys

_all = metadata.distributions


def _without_amp(**kwargs):
    return (d for d in _all(**kwargs) if (d.metadata["Name"] or "").lower() != "flake8-amp")


metadata.distributions = _without_amp
from flake8.main.cli import main

sys.exit(main(sys.argv[1:]))
"""
_WITH_PLUGIN = "import sys\nfrom flake8.main.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def default_paths() -> List[str]:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torch is not installed: pass the source directories to lint")
    root = Path(next(iter(spec.submodule_search_locations)))
    return [str(root / name) for name in ("nn", "optim", "utils")]


def cpu_seconds(program: str, paths: Sequence[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        [sys.executable, "-c", program, "--isolated", "--jobs=1", "--exit-zero", *paths],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"flake8 failed:\n{result.stderr}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def count_files(paths: Sequence[str]) -> int:
    return sum(1 if Path(p).is_file() else sum(1 for _ in Path(p).rglob("*.py")) for p in paths)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "paths",
        nargs="*",
        help="source files/directories (default: torch/nn, torch/optim, torch/utils)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per configuration; the best is kept (default 3)"
    )
    args = parser.parse_args(argv)
    paths = args.paths or default_paths()

    without, with_plugin = [], []
    for _ in range(max(1, args.repeat)):  # interleaved, so drifting load affects both alike
        without.append(cpu_seconds(_WITHOUT_PLUGIN, paths))
        with_plugin.append(cpu_seconds(_WITH_PLUGIN, paths))
    base, amp = min(without), min(with_plugin)

    names = ", ".join(Path(p).name for p in paths)
    print(
        f"{count_files(paths)} files ({names}); best of {len(without)} runs, "
        "CPU seconds, flake8 --jobs=1\n"
    )
    print("| configuration | CPU s | ratio |")
    print("|---|---|---|")
    print(f"| flake8 (default checks, without flake8-amp) | {base:.2f} | 1.00x |")
    print(f"| flake8 (default checks, with flake8-amp) | {amp:.2f} | {amp / base:.2f}x |")
    print(f"\nflake8-amp adds {amp / base - 1:+.0%} to a default flake8 run.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
