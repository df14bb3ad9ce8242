"""Snippet files (flake8-bugbear style), run through real flake8.

Every ``tests/snippets/ampNNN.py`` marks the lines where a finding is expected with a
trailing comment naming the code(s): ``x.half()  # AMP001`` (several: ``# AMP005 AMP006``).
flake8 must report exactly the marked (line, code) pairs for the file's own code and for
every code that is marked somewhere in the file. Each top-level function or class is
one case: positive if it holds a marker, negative otherwise; every ``ampNNN.py`` file
needs at least 15 of each (extra scenario files such as ``amp010_bf16.py`` need not).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SNIPPETS = sorted((Path(__file__).parent / "snippets").glob("amp*.py"))
MARKER = re.compile(r"#\s*((?:AMP\d{3}[\s,]*)+)$")
FINDING = re.compile(r"^.+?:(\d+):\d+: (AMP\d{3}) ")
MIN_CASES = 15


def expected_findings(source: str) -> set:
    expected = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            match = MARKER.search(token.string)
            if match:
                expected |= {
                    (token.start[0], code) for code in re.findall(r"AMP\d{3}", match.group(1))
                }
    return expected


def cases(source: str, expected: set) -> tuple:
    marked_lines = {line for line, _ in expected}
    positives = negatives = 0
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if any(node.lineno <= line <= node.end_lineno for line in marked_lines):
                positives += 1
            else:
                negatives += 1
    return positives, negatives


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[p.stem for p in SNIPPETS])
def test_snippet(snippet: Path, flake8) -> None:
    source = snippet.read_text()
    expected = expected_findings(source)
    own_code = re.match(r"amp\d{3}", snippet.stem).group(0).upper()
    checked_codes = {own_code} | {code for _, code in expected}

    result = flake8(["--isolated", "--select=AMP", snippet])
    assert result.returncode in (0, 1), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    found = set()
    for line in result.stdout.splitlines():
        match = FINDING.match(line)
        assert match, f"unexpected flake8 output: {line}"
        found.add((int(match.group(1)), match.group(2)))
    found = {(line, code) for line, code in found if code in checked_codes}

    missing = sorted(expected - found)
    unexpected = sorted(found - expected)
    assert (
        not missing and not unexpected
    ), f"missing={missing} unexpected={unexpected}\n{result.stdout}"

    if snippet.stem != own_code.lower():
        return
    positives, negatives = cases(source, expected)
    assert positives >= MIN_CASES, f"{snippet.name}: only {positives} positive cases"
    assert negatives >= MIN_CASES, f"{snippet.name}: only {negatives} negative cases"
