"""Cost of replaying a failing step (amp_runtime/replay.py), against the step's own forward.

    python benchmarks/replay_cost.py            # full run
    python benchmarks/replay_cost.py --quick    # fewer repetitions

A replay runs the step's forward again with per-op checks (AMP101) and, to localize a
backward-only fault (AMP103), a backward with a hook on every autograd node; it happens once per
anomaly episode, not per step. The table shows median CPU times of the plain forward of the
GPT-like model of guard_overhead.py, of a plain forward and backward, and of both replays, with
their ratio to the plain forward measured in the same repetition. What a healthy step pays for
keeping its calls is the 'trace="auto" without replay' row of guard_overhead.py.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import amp_runtime
from guard_overhead import SHAPES, TinyGPT

#: Replays timed per repetition (each in a step of its own).
REPLAYS = 5


def timed(function) -> float:
    start = time.process_time()
    function()
    return time.process_time() - start


def measure(shape, dtype, repetitions: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(shape.vocab, shape.width, shape.heads, shape.layers, shape.length)
    idx = torch.randint(shape.vocab, (shape.batch, shape.length))

    def forward():
        with torch.autocast("cpu", dtype=dtype):
            return model(idx)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        forward().float().mean().backward()

    times = {"forward": [], "forward + backward": [], "replay (forward)": [],
             "replay (forward + backward)": []}
    limits = amp_runtime.Thresholds(auto_quiet_steps=0)  # no episode: replay every request
    for _ in range(repetitions):
        plain = statistics.median(timed(forward) for _ in range(REPLAYS))
        times["forward"].append(plain)
        trained = statistics.median(timed(forward_backward) for _ in range(REPLAYS))
        times["forward + backward"].append(trained / plain)
        with amp_runtime.guard(policy="record", thresholds=limits) as guard:
            forward()  # the first step learns the root module
            guard.step()
            for code, name in (("AMP112", "replay (forward)"),
                               ("AMP103", "replay (forward + backward)")):
                samples = []
                for _ in range(REPLAYS):
                    forward()
                    guard.request_replay(code)
                    samples.append(timed(guard.replayer.flush))
                    guard.step()
                times[name].append(statistics.median(samples) / plain)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    repetitions = 3 if options.quick else 15
    print(f"torch {torch.__version__}, CPU time; medians of {repetitions} repetitions\n")
    print("| shape | precision | what | ms | × forward |")
    print("|---|---|---|---|---|")
    for shape_name in ("compute", "host"):
        for dtype in (torch.bfloat16, torch.float16):
            shape = SHAPES[shape_name][dtype]
            times = measure(shape, dtype, repetitions)
            plain = statistics.median(times.pop("forward"))
            label = f"{shape_name} (d={shape.width}, {shape.layers}x{shape.length}x{shape.batch})"
            precision = str(dtype).replace("torch.", "")
            print(f"| {label} | {precision} | forward | {plain * 1e3:.2f} | 1.00 |")
            for name, ratios in times.items():
                ratio = statistics.median(ratios)
                print(f"| {label} | {precision} | {name} | {plain * ratio * 1e3:.2f} "
                      f"| {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
