"""How right is the linter on realistic code? Precision and recall per code on a labelled corpus.

    python benchmarks/lint_quality.py                  # the bundled corpus, benchmarks/lint_corpus/
    python benchmarks/lint_quality.py --show-misses    # also list every false alarm and miss
    python benchmarks/lint_quality.py benchmarks/lint_heldout   # the held-out corpus
    python benchmarks/lint_quality.py path/to/corpus

``benchmarks/lint_heldout/`` is a second corpus, written and labelled by someone other than
the rules' author before it was ever linted. Tune the rules on ``lint_corpus``; check on
``lint_heldout`` that the tuning generalises (fixing a rule for one of its files makes it a
training file: add a fresh one instead).

The corpus is full training and model files (scripts, trainers, model code in the styles of
nanoGPT, timm, pytorch/examples, Hugging Face, Lightning, detectron2, fairseq...) with real
bugs and the idiomatic code around them. A line the linter must flag ends with a label comment
``# expect: AMP002`` (several codes: ``# expect: AMP005 AMP006``); every other line must stay
silent. flake8 runs as users run it (``--select=AMP``, ``--isolated``), one subprocess over the
whole corpus; a finding counts when its (file, line, code) matches a label. An AMP000 line (a
file the plugin could not analyse) is reported separately and fails the run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

CORPUS = Path(__file__).resolve().parent / "lint_corpus"
LABEL = re.compile(r"#\s*expect:\s*((?:AMP\d{3}[\s,]*)+)")
FINDING = re.compile(r"^(.+?):(\d+):\d+: (AMP\d{3}) (.*)$")

Key = Tuple[str, int, str]


@dataclass
class Quality:
    """Matched, false and missed findings of one run, by code."""

    true: Counter = field(default_factory=Counter)
    false: Dict[str, List[str]] = field(default_factory=dict)
    missed: Dict[str, List[str]] = field(default_factory=dict)
    unanalysed: List[str] = field(default_factory=list)

    def codes(self) -> List[str]:
        return sorted(set(self.true) | set(self.false) | set(self.missed))

    def precision(self, code: Optional[str] = None) -> float:
        tp, fp = self._counts(code)[:2]
        return tp / (tp + fp) if tp + fp else 1.0

    def recall(self, code: Optional[str] = None) -> float:
        tp, _, fn = self._counts(code)
        return tp / (tp + fn) if tp + fn else 1.0

    def _counts(self, code: Optional[str]) -> Tuple[int, int, int]:
        codes = [code] if code else self.codes()
        return (
            sum(self.true[c] for c in codes),
            sum(len(self.false.get(c, ())) for c in codes),
            sum(len(self.missed.get(c, ())) for c in codes),
        )

    def table(self) -> str:
        rows = [
            "| code | labelled | found | false alarms | precision | recall |",
            "|---|---|---|---|---|---|",
        ]
        for code in [*self.codes(), None]:
            tp, fp, fn = self._counts(code)
            rows.append(
                f"| {code or 'all'} | {tp + fn} | {tp} | {fp} | "
                f"{self.precision(code):.2f} | {self.recall(code):.2f} |"
            )
        return "\n".join(rows)


def labels(files: Sequence[Path], root: Path) -> Set[Key]:
    expected: Set[Key] = set()
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = LABEL.search(line)
            if match:
                for code in re.findall(r"AMP\d{3}", match.group(1)):
                    expected.add((path.relative_to(root).as_posix(), number, code))
    return expected


def lint(root: Path, extra_args: Sequence[str] = ()) -> Tuple[Set[Key], List[str]]:
    """Findings of ``flake8 --select=AMP`` over ``root``, and its AMP000 lines."""
    result = subprocess.run(
        [sys.executable, "-m", "flake8", "--isolated", "--select=AMP", *extra_args, "."],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if result.returncode not in (0, 1) or "Traceback" in result.stderr:
        sys.exit(f"flake8 failed:\n{result.stderr}")
    found: Set[Key] = set()
    unanalysed = []
    for line in result.stdout.splitlines():
        match = FINDING.match(line)
        if not match:
            sys.exit(f"unexpected flake8 output: {line}")
        path, number, code, message = match.groups()
        path = Path(path).as_posix().removeprefix("./")
        if code == "AMP000":
            unanalysed.append(f"{path}: {message}")
        else:
            found.add((path, int(number), code))
    return found, unanalysed


def measure(root: Path = CORPUS) -> Quality:
    files = sorted(root.rglob("*.py"))
    expected = labels(files, root)
    found, unanalysed = lint(root)
    quality = Quality(unanalysed=unanalysed)
    for path, line, code in sorted(found | expected):
        key = (path, line, code)
        where = f"{path}:{line}"
        if key in found and key in expected:
            quality.true[code] += 1
        elif key in found:
            quality.false.setdefault(code, []).append(where)
        else:
            quality.missed.setdefault(code, []).append(where)
    return quality


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "corpus", nargs="?", type=Path, default=CORPUS, help="labelled corpus folder"
    )
    parser.add_argument("--show-misses", action="store_true", help="list false alarms and misses")
    args = parser.parse_args(argv)
    quality = measure(args.corpus.resolve())
    print(quality.table())
    if args.show_misses:
        for title, entries in (("false alarms", quality.false), ("missed", quality.missed)):
            for code, places in sorted(entries.items()):
                for place in places:
                    print(f"{title}: {code} {place}")
    for line in quality.unanalysed:
        print(f"not analysed: {line}")
    return 1 if quality.unanalysed else 0


if __name__ == "__main__":
    sys.exit(main())
