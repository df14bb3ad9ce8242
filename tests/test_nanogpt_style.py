"""A nanoGPT-style training script (``examples/train_nanogpt.py``) under the guard, on the CPU
in bf16 and fp16: ``with amp_runtime.guard()`` in-process and ``python -m amp_runtime run`` as a
user would start it. Healthy runs must end as the unguarded run does (exit code, printed losses,
the checkpoint's weights) and report nothing.

The script keeps nanoGPT's idioms: ``GradScaler(enabled=(dtype == "float16"))`` called
unconditionally (disabled in bf16), ``nullcontext()`` on the CPU (or autocast with
``--cpu-autocast``), gradient accumulation with the next batch fetched between forward and
backward, an ``estimate_loss()`` under ``no_grad`` with ``model.eval()``/``model.train()``, a
checkpoint save, and ``--compile`` (tested with aot_eager here; both backends in test_compile).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import amp_runtime

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_nanogpt.py"

#: dtype and autocast choice: nanoGPT on a CPU (nullcontext: the dtype only enables the scaler)
#: and with CPU autocast (the low-precision forward the guard watches).
CONFIGURATIONS = [
    ("bfloat16", []),
    ("float16", []),
    ("bfloat16", ["--cpu-autocast"]),
    ("float16", ["--cpu-autocast"]),
]
IDS = [f"{dtype}{'-autocast' if extra else '-nullcontext'}" for dtype, extra in CONFIGURATIONS]


def load_script():
    spec = importlib.util.spec_from_file_location("train_nanogpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_weights(out_dir):
    return torch.load(Path(out_dir) / "final.pt")["model"]


def assert_same_weights(out_dir, expected_dir):
    mine, theirs = final_weights(out_dir), final_weights(expected_dir)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("dtype, extra", CONFIGURATIONS, ids=IDS)
def test_with_guard_in_process_trains_as_without_and_is_quiet(dtype, extra, tmp_path):
    script = load_script()
    argv = ["--dtype", dtype, *extra, "--max-iters", "8"]
    plain = script.main([*argv, "--out-dir", str(tmp_path / "plain")])
    with amp_runtime.guard() as g:  # the defaults: warn, trace="auto"
        guarded = script.main([*argv, "--out-dir", str(tmp_path / "guarded")])
    assert guarded == plain
    assert_same_weights(tmp_path / "guarded", tmp_path / "plain")
    assert [str(e) for e in g.report.events] == []
    assert g.step_index == 9  # nanoGPT runs max_iters + 1 optimizer steps
    assert (tmp_path / "guarded" / "ckpt.pt").exists()


def run_script(*command, cwd, env=None):
    return subprocess.run([sys.executable, *command], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("dtype, extra", [CONFIGURATIONS[0], CONFIGURATIONS[3]],
                         ids=[IDS[0], IDS[3]])
def test_python_m_amp_runtime_run_keeps_exit_code_output_and_weights(dtype, extra, tmp_path):
    argv = ["--dtype", dtype, *extra, "--max-iters", "6"]
    plain = run_script(str(SCRIPT), *argv, "--out-dir", "plain", cwd=tmp_path)
    guarded = run_script("-m", "amp_runtime", "run", "--out", "report", str(SCRIPT), *argv,
                         "--out-dir", "guarded", cwd=tmp_path)
    assert (guarded.returncode, plain.returncode) == (0, 0), guarded.stderr
    assert guarded.stdout == plain.stdout  # every printed loss, to six decimals
    assert_same_weights(tmp_path / "guarded", tmp_path / "plain")
    assert "amp_runtime: no events" in guarded.stderr
    assert (tmp_path / "report" / "events.jsonl").read_text(encoding="utf-8") == ""
    steps = (tmp_path / "report" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in steps] == list(range(7))


def test_python_m_amp_runtime_run_with_compile(tmp_path):
    """``--compile`` as nanoGPT does it (aot_eager to keep it quick; one intra-op thread so
    that the compiled kernels repeat bit for bit)."""
    argv = ["--dtype", "bfloat16", "--cpu-autocast", "--compile", "--compile-backend",
            "aot_eager", "--max-iters", "4", "--eval-interval", "2"]
    env = {"OMP_NUM_THREADS": "1"}
    plain = run_script(str(SCRIPT), *argv, "--out-dir", "plain", cwd=tmp_path, env=env)
    guarded = run_script("-m", "amp_runtime", "run", "--out", "report", str(SCRIPT), *argv,
                         "--out-dir", "guarded", cwd=tmp_path, env=env)
    assert (guarded.returncode, plain.returncode) == (0, 0), guarded.stderr
    assert guarded.stdout == plain.stdout
    assert_same_weights(tmp_path / "guarded", tmp_path / "plain")
    assert "amp_runtime: no events" in guarded.stderr


def test_a_failing_script_keeps_its_exit_code_under_run(tmp_path):
    """A bad argument is the script's own error: argparse's exit status 2, as without the guard."""
    plain = run_script(str(SCRIPT), "--dtype", "float8", cwd=tmp_path)
    guarded = run_script("-m", "amp_runtime", "run", str(SCRIPT), "--dtype", "float8",
                         cwd=tmp_path)
    assert guarded.returncode == plain.returncode == 2
    assert "invalid choice: 'float8'" in guarded.stderr
