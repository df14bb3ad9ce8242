"""Where a guarded training step synchronises the host with a CUDA device, call by call.

    python benchmarks/host_syncs.py                          # GPT-2-124M-shaped step
    python benchmarks/host_syncs.py --shape host --steps 40  # the host-bound step

For each precision and guard variant of ``guard_overhead.py``: after ``--steps`` steps, 32 more
run under ``torch.cuda.set_sync_debug_mode("warn")``; each synchronising call is counted by the
stack it came from (its torch and amp_runtime frames), next to the guard's own reading counts
(copies started, batches read once arrived, waits). A steady step should show no call at all.
"""
from __future__ import annotations

import argparse
import collections
import os
import traceback

import torch

from guard_overhead import SHAPES, VARIANT_KEYS, VARIANTS, Trainer, sync_debug_mode

COUNTED_STEPS = 32


def _stack() -> str:
    """The torch and amp_runtime frames of the current stack, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if "amp_runtime" in f.filename or "torch" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(frames[-6:]))


def sync_sites(trainer: Trainer, variant: str, steps: int):
    """(syncs per step by stack, reading counts over the counted steps, event codes)."""
    sites: collections.Counter = collections.Counter()
    with VARIANTS[variant]() as guard:
        for _ in range(steps):
            trainer.step()
        trainer.sync()
        counts = guard.readings.counts
        before = (counts.copies, counts.reads, counts.waits)
        with sync_debug_mode(lambda: sites.update([_stack()])):
            for _ in range(COUNTED_STEPS):
                trainer.step()
        trainer.sync()
        during = [now - then for now, then in zip(
            (counts.copies, counts.reads, counts.waits), before)]
    return sites, during, dict(guard.report.codes())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES["cuda"]), default="gpt2-124m")
    parser.add_argument("--steps", type=int, default=40, help="steps before counting")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the sync debug mode is CUDA's)")
    for dtype, shape in SHAPES["cuda"][options.shape].items():
        trainer = Trainer(shape, dtype, "cuda")
        for key in ("off", "auto", "always"):
            variant = VARIANT_KEYS[key]
            sites, (copies, reads, waits), codes = sync_sites(trainer, variant, options.steps)
            precision = str(dtype).replace("torch.", "")
            print(f"{shape.label()} {precision} {variant}: "
                  f"{sum(sites.values()) / COUNTED_STEPS:.2f} host syncs per step; readings over "
                  f"{COUNTED_STEPS} steps: {copies} copies, {reads} read, {waits} waited for; "
                  f"events {codes or 'none'}", flush=True)
            for stack, count in sites.most_common(8):
                print(f"    {count / COUNTED_STEPS:.2f}/step  {stack}")


if __name__ == "__main__":
    main()
