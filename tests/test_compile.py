"""torch.compile under the guard (backends aot_eager and inductor on the CPU).

Each scenario runs in a fresh interpreter (``tests/compiled_training.py``): dynamo's caches and
counters are process-wide. One intra-op thread: inductor's CPU kernels reduce in a
thread-dependent order, so two unguarded runs with several threads already differ in the last
bits. These are the suite's slowest tests (each compiles a model, inductor's a few times over);
they are kept few and small.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def compiled_run(scenario, backend, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    done = subprocess.run([sys.executable, str(TESTS / "compiled_training.py"), scenario, backend],
                          capture_output=True, text=True, timeout=900, env=env, cwd=TESTS.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_nanogpt_trains_as_without_the_guard_and_compiles_as_often(backend, tmp_path):
    """Bit-identical losses and weights, the same graphs and no recompilation (the guard keeps its
    mode off the stack from the first compilation on), no event, no heap walk."""
    result = compiled_run("nanogpt", backend, tmp_path)
    assert result["losses_equal"] and result["weights_equal"]
    assert result["guarded"] == result["plain"]  # the training and the eval graph, nothing more
    assert result["guarded"]["recompiles"] == 0
    assert result["events"] == []


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return compiled_run("faults", "aot_eager", tmp_path_factory.mktemp("faults"))


def test_step_level_checks_find_a_nan_loss_and_nan_gradients_and_name_the_step(faults):
    run = faults["nan_loss"]
    first = {}
    for event in run["events"]:
        first.setdefault(event["code"], event)
    assert set(first) == {"AMP112", "AMP103"}  # no AMP008: backward runs outside autocast
    assert first["AMP112"]["step"] == 3 and first["AMP103"]["step"] == 3
    assert first["AMP103"]["module"] == "fc1"  # the compiled model's own names, no _orig_mod
    assert run["steps"] == 10
    assert run["replayed"] == [3]  # the eager module, replayed without a recompilation
    assert run["end"] == run["warm"] == {"graphs": 1, "recompiles": 0}


def test_the_loss_scale_checks_work_on_a_compiled_model(faults):
    run = faults["overflow"]
    codes = {event["code"] for event in run["events"]}
    assert codes == {"AMP107", "AMP108"}
    assert all(event["step"] is not None and event["module"] is None for event in run["events"])
    assert run["end"] == run["warm"] == {"graphs": 1, "recompiles": 0}


def test_what_the_compiler_runs_while_compiling_is_not_judged(tmp_path):
    """A compiler tracing autograd under autocast (here a backward compiler, run lazily at the
    first backward) is not the user's backward inside an autocast region: no false AMP008."""
    assert compiled_run("compiler_work", "aot_eager", tmp_path)["events"] == []


def test_torch_compile_called_inside_the_guard_compiles_once(tmp_path):
    """Dynamo not loaded when the guard is entered (``python -m amp_runtime run``): the guard
    learns of compilations through ``torch.compile`` and the model compiles once."""
    result = compiled_run("compiled_inside_the_guard", "aot_eager", tmp_path)
    assert result["dynamo_loaded_before"] is False
    assert result["counts"] == {"graphs": 1, "recompiles": 0}
    assert result["events"] == [] and result["steps"] == 12
