"""The README's quick start does what it says.

Its guard example runs as written and reports what its comment promises; the flake8
output it shows is what flake8 prints for the bundled example; the set-up section names
exactly the two commands, and CI runs the test one.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def block_after(marker: str, language: str) -> str:
    match = re.search(re.escape(marker) + rf".*?```{language}\n(.*?)^```", README, re.S | re.M)
    assert match, f"README has no ```{language} block after {marker!r}"
    return match.group(1)


def test_guard_quick_start_reports_the_injected_overflow():
    code = block_after("<!-- quick-start-guard", "python")
    code += "\nimport json\nprint(json.dumps(g.report.to_json()))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    codes = [event["code"] for event in report["events"]]
    assert "AMP108" in codes and "AMP107" in codes, result.stdout
    assert codes.index("AMP108") < codes.index("AMP107")
    assert "AMP103" not in codes  # the scaler caught every inf


def test_shown_lint_output_is_what_flake8_prints(flake8):
    shown = block_after("### Lint", "text").splitlines()
    assert shown
    result = flake8(["--isolated", "--select=AMP", "examples/"])
    assert result.returncode == 1, result.stderr
    printed = set(result.stdout.splitlines())
    assert [line for line in shown if line not in printed] == []


def test_setup_names_exactly_the_two_commands_and_ci_runs_the_test_one():
    setup = block_after("## Set-up", "bash")
    commands = [line.split("#")[0].strip() for line in setup.splitlines() if line.strip()]
    assert commands == ["bash examples/demo.sh", "bash tests/run.sh"]
    assert "bash tests/run.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
