"""torch.compile with and without amp_runtime.guard: compile time, graphs and steady-state steps.

    python benchmarks/compile_overhead.py                  # aot_eager and inductor, 5 repetitions
    python benchmarks/compile_overhead.py --quick          # 2 repetitions
    python benchmarks/compile_overhead.py --backend inductor --repeat 9

Trains the nanoGPT-style example (``examples/train_nanogpt.py``, bf16 autocast on the CPU, its
disabled GradScaler, gradient accumulation, an eval every few iterations) compiled with each
backend, unguarded and under ``amp_runtime.guard()``. Every run is a fresh interpreter with
inductor's and dynamo's caches disabled (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``), so each pays
the whole compilation; the variants alternate within each repetition so that drift hits them
alike. Reported per backend and variant (medians):

* compile s: the time dynamo, AOTAutograd and inductor spent compiling (between dynamo's compile
  start and end callbacks, the lazily compiled backward included);
* first iteration s: the wall time of the first training iteration, compilation included;
* graphs / recompiles: dynamo's counters at the end (the guard must add none);
* ms/iteration: the wall time per iteration after the first two.

One intra-op thread (``OMP_NUM_THREADS=1``) keeps the numbers steadier and the runs
bit-identical. Run it on a quiet machine; a shared one gives noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("no guard", "guard()")


def child(backend: str, guarded: bool, iterations: int) -> dict:
    """One run in this (fresh) interpreter; its measurements."""
    import contextlib
    import importlib.util
    import warnings

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    import amp_runtime

    spec = importlib.util.spec_from_file_location("train_nanogpt",
                                                  ROOT / "examples" / "train_nanogpt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    compiling = {"since": None, "total": 0.0}

    def started(*args):
        compiling["since"] = time.perf_counter()

    def ended(*args):
        compiling["total"] += time.perf_counter() - compiling["since"]

    torch._dynamo.callback_handler.register_start_callback(started)
    torch._dynamo.callback_handler.register_end_callback(ended)
    iteration_ends = []
    real_print = print

    def timed_print(*args, **kwargs):  # the script prints one line per iteration
        if args and str(args[0]).startswith("iter "):
            iteration_ends.append(time.perf_counter())
        real_print(*args, **kwargs, file=sys.stderr)

    script.print = timed_print
    argv = ["--compile", "--compile-backend", backend, "--cpu-autocast", "--dtype", "bfloat16",
            "--max-iters", str(iterations - 1), "--eval-interval", str(iterations),
            "--out-dir", tempfile.mkdtemp()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        with amp_runtime.guard(policy="record") if guarded else contextlib.nullcontext() as g:
            script.main(argv)
    steady = [b - a for a, b in zip(iteration_ends[2:], iteration_ends[3:])]
    return {
        "compile_s": compiling["total"],
        "first_iteration_s": iteration_ends[0] - start,
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "ms_per_iteration": 1000 * statistics.median(steady) if steady else float("nan"),
        "events": 0 if g is None else len(g.report),
    }


def measure(backend: str, guarded: bool, iterations: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    command = [sys.executable, __file__, "--child", backend, str(int(guarded)), str(iterations)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{backend} {'guarded' if guarded else 'unguarded'} run failed:\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("aot_eager", "inductor"), action="append",
                        help="backend to measure (repeatable; default: both)")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions (default: 5)")
    parser.add_argument("--iterations", type=int, default=12,
                        help="training iterations per run (default: 12)")
    parser.add_argument("--quick", action="store_true", help="2 repetitions")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        backend, guarded, iterations = options.child
        print(json.dumps(child(backend, guarded == "1", int(iterations))))
        return
    repeat = 2 if options.quick else options.repeat
    print("| backend | variant | compile s | first iteration s | graphs | recompiles "
          "| ms/iteration | events |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in options.backend or ("aot_eager", "inductor"):
        runs = {variant: [] for variant in VARIANTS}
        for _ in range(repeat):
            for variant in VARIANTS:
                runs[variant].append(measure(backend, variant != "no guard", options.iterations))
        for variant, results in runs.items():
            def median(key):
                return statistics.median(r[key] for r in results)

            print(f"| {backend} | {variant} | {median('compile_s'):.2f} "
                  f"| {median('first_iteration_s'):.2f} | {max(r['graphs'] for r in results)} "
                  f"| {max(r['recompiles'] for r in results)} | {median('ms_per_iteration'):.2f} "
                  f"| {max(r['events'] for r in results)} |")


if __name__ == "__main__":
    main()
