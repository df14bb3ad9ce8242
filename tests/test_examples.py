"""The bundled examples do what the README's main command promises.

``examples/buggy_train.py`` and ``train_overflow.py`` mark each bug with the code the linter
must report (``# AMP005``); real flake8, run as ``examples/demo.sh`` runs it, must find
exactly those and nothing in the other scripts. The training scripts run on CPU, and under the guard
the healthy one is quiet while the overflowing one is pinned to its layer.
"""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MARKER = re.compile(r"#\s*(AMP\d{3})\s*$")
#: The real-world bugs buggy_train.py is meant to demonstrate (REAL_WORLD_IDIOMS.md).
DEMONSTRATED = {"AMP003", "AMP005", "AMP006", "AMP007", "AMP008", "AMP009"}


def marked_findings(path):
    return {
        (number, match.group(1))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if (match := MARKER.search(line))
    }


@pytest.fixture(scope="module")
def lint_findings():
    """{file name: {(line, code)}} from the demo's own command, run from the repository root."""
    result = subprocess.run(
        [sys.executable, "-m", "flake8", "--select=AMP", "examples/"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode in (0, 1), result.stderr
    found = {}
    for line in result.stdout.splitlines():
        path, number, _col, message = line.split(":", 3)
        found.setdefault(Path(path).name, set()).add((int(number), message.split()[0]))
    return found


def test_buggy_script_marks_the_real_world_bugs():
    assert {code for _, code in marked_findings(EXAMPLES / "buggy_train.py")} == DEMONSTRATED


@pytest.mark.parametrize("script", ["buggy_train.py", "train_overflow.py"])
def test_linter_finds_exactly_the_marked_bugs(script, lint_findings):
    expected = marked_findings(EXAMPLES / script)
    assert expected and lint_findings.get(script, set()) == expected


@pytest.mark.parametrize("script", ["train_healthy.py", "train_nanogpt.py"])
def test_correctly_written_scripts_have_no_findings(script, lint_findings):
    assert lint_findings.get(script, set()) == set()


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*argv):
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def logged_scales(output):
    return [float(value) for value in re.findall(r"scale (\S+)", output)]


def losses_decrease(output):
    losses = [float(value) for value in re.findall(r"loss (\S+)", output)]
    return losses[-1] < losses[0]


def test_healthy_script_trains():
    output = run_script("examples/train_healthy.py", "--steps", "20")
    assert losses_decrease(output)
    assert re.search(r"accuracy \d\.\d+ after 20 steps \(float16\)", output)
    assert set(logged_scales(output)) == {65536.0}


def test_healthy_script_trains_in_bfloat16_without_loss_scaling(capsys):
    load_example("train_healthy").main(["--steps", "20", "--dtype", "bfloat16"])
    output = capsys.readouterr().out
    assert losses_decrease(output)
    assert set(logged_scales(output)) == {1.0}


def test_overflow_script_loses_steps_silently():
    output = run_script("examples/train_overflow.py", "--steps", "8")
    assert " nan " in output
    scales = logged_scales(output)
    assert scales == sorted(scales, reverse=True) and scales[-1] < scales[0]


def guarded_run(name, steps):
    amp_runtime = pytest.importorskip("amp_runtime")
    with amp_runtime.guard(policy="record") as guard:
        load_example(name).main(["--steps", str(steps)])
    return guard.report.events


def test_guard_is_quiet_on_the_healthy_script():
    assert [str(event) for event in guarded_run("train_healthy", 20)] == []


def test_guard_pins_the_overflow_to_the_interaction_layer_and_sees_the_scale_decline():
    """What train_overflow.py's docstring promises: AMP101 and AMP004 in ``interaction``, AMP108."""
    events = guarded_run("train_overflow", 24)
    forward = [e for e in events if e.code == "AMP101"]
    assert forward and all(e.module == "interaction" and e.op == "pow" for e in forward)
    assert any(e.code == "AMP004" and e.module == "interaction" for e in events)
    assert any(e.code == "AMP108" for e in events)
