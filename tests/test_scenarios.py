"""Training scripts with injected faults, and healthy look-alikes, run under the real guard.

Each script in ``tests/scenarios/`` was written from the rule pages alone, before the guard
ever ran it: its docstring opens with ``EXPECT:`` (the event codes the pages say the fault
must produce, or ``none`` for a healthy control), may name on a ``MAY:`` line codes the pages
leave open (a NaN gradient norm judged by AMP104 too), and says in a ``FAULT:`` paragraph what
was injected where. The script trains on the CPU under ``amp_runtime.guard(policy="record")``
and prints ``EVENTS [...]``, the codes it recorded: every expected code must be among them and
nothing outside the expected and the open ones. A missed fault and a false alarm fail alike.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.py"))
EXPECT = re.compile(r'^"""EXPECT: (.+)$', re.MULTILINE)
MAY = re.compile(r"^MAY: (.+)$", re.MULTILINE)
CODE = re.compile(r"AMP\d{3}")


def expected_codes(script: Path) -> set:
    match = EXPECT.search(script.read_text(encoding="utf-8"))
    assert match, f"{script.name} names no EXPECT line"
    return set(CODE.findall(match.group(1)))


def open_codes(script: Path) -> set:
    match = MAY.search(script.read_text(encoding="utf-8"))
    return set(CODE.findall(match.group(1))) if match else set()


def test_there_are_faults_and_healthy_controls():
    kinds = [bool(expected_codes(script)) for script in SCENARIOS]
    assert kinds.count(True) >= 5 and kinds.count(False) >= 3


@pytest.mark.parametrize("script", SCENARIOS, ids=lambda path: path.stem)
def test_guard_reports_exactly_the_injected_fault(script):
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("EVENTS ")]
    assert len(printed) == 1, result.stdout[-3000:]
    recorded = set(json.loads(printed[0][len("EVENTS "):]))
    expected, allowed = expected_codes(script), expected_codes(script) | open_codes(script)
    assert expected <= recorded <= allowed, result.stdout[-3000:] + result.stderr[-3000:]
