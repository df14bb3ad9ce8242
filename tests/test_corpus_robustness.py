"""Robustness over real code: lint the whole CPython standard library and the installed
torch package through the plugin, in-process on two worker processes.

Part of the normal suite (about two minutes on two cores): no file may crash the
checker or produce an AMP000 "could not analyse" line, except files Python itself
cannot parse (flake8 reports those as E902/E999 and never calls the plugin).
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sysconfig
import tokenize
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from flake8_amp.plugin import AmpChecker


def _stdlib_files() -> List[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    ]


def _torch_files() -> List[Path]:
    spec = __import__("importlib.util").util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py"))


def _lint(path: Path) -> Tuple[str, Optional[str], int]:
    """(path, problem or None, number of findings)."""
    try:
        with tokenize.open(path) as handle:
            source = handle.read()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError, OSError):
        return str(path), None, 0  # flake8 reports these itself; the plugin never sees them
    try:
        findings = list(AmpChecker(tree, source.splitlines(True), str(path)).run())
    except Exception as error:  # the plugin must never raise: record it as the failure
        return str(path), f"raised {type(error).__name__}: {error}", 0
    failures = [message for _, _, message, _ in findings if message.startswith("AMP000")]
    return str(path), (failures[0] if failures else None), len(findings)


@pytest.mark.parametrize("corpus", ["stdlib", "torch"])
def test_corpus_lints_without_crash(corpus):
    files = _stdlib_files() if corpus == "stdlib" else _torch_files()
    if not files:
        pytest.skip(f"{corpus} sources not installed")
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with context.Pool(2) as pool:
        results = pool.map(_lint, files, chunksize=16)
    problems = [(path, problem) for path, problem, _ in results if problem]
    assert not problems, f"{len(problems)} of {len(files)} files failed, e.g. {problems[:5]}"
    assert len(results) == len(files)
