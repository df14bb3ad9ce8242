"""Compiled training runs for tests/test_compile.py, in a fresh interpreter each (dynamo's caches
and counters are process-wide):

    python tests/compiled_training.py SCENARIO BACKEND

prints one JSON object. Run with OMP_NUM_THREADS=1: inductor's CPU kernels reduce in a
thread-dependent order, so two unguarded multi-threaded runs already differ in the last bits.
"""
import contextlib
import gc
import importlib.util
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

ROOT = Path(__file__).resolve().parents[1]


def load_nanogpt():
    spec = importlib.util.spec_from_file_location("train_nanogpt",
                                                  ROOT / "examples" / "train_nanogpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guard_without_heap_walks():
    """Make ``gc.get_objects()`` fail when the guard calls it (torch's own calls go through)."""
    real = gc.get_objects

    def get_objects(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename.startswith(amp_runtime.events.PACKAGE_DIR):
            raise AssertionError("the guard searched the heap")
        return real(*args, **kwargs)

    gc.get_objects = get_objects


def reset_compilation():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def compiled_counts():
    counters = torch._dynamo.utils.counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}


def events_of(g):
    return [{"code": e.code, "step": e.step, "module": e.module, "source": e.source}
            for e in g.report.events]


def nanogpt(backend):
    """The nanoGPT-style script, compiled, bf16 autocast with its disabled scaler: unguarded,
    then guarded."""
    script = load_nanogpt()
    runs = []
    for guarded in (False, True):
        reset_compilation()
        out = tempfile.mkdtemp()
        argv = ["--compile", "--compile-backend", backend, "--cpu-autocast", "--dtype", "bfloat16",
                "--max-iters", "6", "--eval-interval", "3", "--out-dir", out]
        with amp_runtime.guard(policy="record") if guarded else contextlib.nullcontext() as g:
            losses = script.main(argv)
        weights = torch.load(Path(out) / "final.pt")["model"]
        runs.append((losses, weights, compiled_counts(), [] if g is None else events_of(g)))
    (plain_losses, plain_weights, plain_counts, _), (losses, weights, counts, events) = runs
    return {
        "losses_equal": losses == plain_losses,
        "weights_equal": all(torch.equal(weights[k], plain_weights[k]) for k in weights),
        "plain": plain_counts, "guarded": counts, "events": events,
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def faulty(backend, dtype, scaled, blow_up, nan_at, steps=10):
    """A compiled model whose loss turns NaN at step ``nan_at`` or is multiplied by ``blow_up``;
    the compilation counts after the first two steps and at the end, and the steps replayed (on
    the eager module)."""
    reset_compilation()
    torch.manual_seed(0)
    model = torch.compile(Net(), backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    generator = torch.Generator().manual_seed(1)
    with amp_runtime.guard(policy="record") as g:
        replayer = g.replayer
        for step in range(steps):
            x = torch.randn(8, 16, generator=generator)
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x).float().pow(2).mean() * blow_up
            if step == nan_at:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == 1:
                warm = compiled_counts()
    return {"warm": warm, "end": compiled_counts(), "events": events_of(g),
            "steps": g.step_index,
            "replayed": [o.step for o in replayer.outcomes if o.skipped is None]}


def faults(backend):
    return {
        "nan_loss": faulty(backend, torch.bfloat16, scaled=False, blow_up=1.0, nan_at=3),
        "overflow": faulty(backend, torch.float16, scaled=True, blow_up=1e30, nan_at=None,
                           steps=24),
    }


def compiler_work(backend):
    """A backend whose backward compiler (run lazily, at the first backward) calls autograd under
    autocast, as compilers trace graphs: that is the compiler's work, not the user's backward.
    The backward is called through a name bound before the guard (not an observed entry point),
    so nothing but the compilation window keeps the guard from judging it (a false AMP008)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.autograd import backward as unobserved_backward

    def forward_compiler(graph, inputs):
        return make_boxed_func(graph.forward)

    def backward_compiler(graph, inputs):
        probe = torch.ones(2, requires_grad=True)
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.autograd.grad((probe * 2).sum(), probe)
        return make_boxed_func(graph.forward)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_runtime.guard(policy="record") as g:
        # past the first, watched steps: the guard's mode is off the stack from here on
        for _ in range(g.thresholds.watch_steps + 1):
            model(torch.randn(4, 16)).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=forward_compiler,
                                                             bw_compiler=backward_compiler))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(torch.randn(4, 16)).float().sum()
        unobserved_backward(loss)
    return {"events": events_of(g)}


def compiled_inside_the_guard(backend):
    """``python -m amp_runtime run`` enters the guard before the script imports anything of
    dynamo: ``torch.compile`` called inside the guard must still let it follow compilations."""
    model = Net()
    with amp_runtime.guard(policy="record") as g:
        loaded_before = "torch._dynamo" in sys.modules  # (building an optimizer loads it)
        compiled = torch.compile(model, backend=backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(g.thresholds.watch_steps + 4):  # watched steps, then unwatched ones
            compiled(torch.randn(4, 16)).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"dynamo_loaded_before": loaded_before, "counts": compiled_counts(),
            "events": events_of(g), "steps": g.step_index}


SCENARIOS = {"nanogpt": nanogpt, "faults": faults, "compiler_work": compiler_work,
             "compiled_inside_the_guard": compiled_inside_the_guard}

if __name__ == "__main__":
    scenario, backend = sys.argv[1:3]
    guard_without_heap_walks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = SCENARIOS[scenario](backend)
    print(json.dumps(result))
