"""Overhead of amp_runtime.guard on a small GPT-like training step (CPU).

    python benchmarks/guard_overhead.py            # full run
    python benchmarks/guard_overhead.py --quick    # fewer repetitions

Three shapes: "compute" (d=128, matmul-bound), "host" (d=32, about 8 ms a step: the
host-bound shape of the guard issue, the proxy for a GPU where kernels are fast and Python
time per op is what shows) and "tiny" (d=32, about 4 ms: harsher still). Precisions: fp32,
and bf16/fp16 autocast (fp16 with a GradScaler). Variants are alternated within one process
so that drift hits all of them alike; the table shows the median CPU time per step in steady
state, the median of its ratio to the unguarded step of the same repetition, and the same
ratio over the warm-up steps (a guard's start-up). One intra-op thread keeps the numbers
steadier; run-to-run noise on a shared 2-core VM is still a few percent.

What dominates (profiled), in the host-bound shapes:
* Watched steps (the first 8, then one in 16): the TorchFunctionMode's dispatch of every
  torch call, ~1 us for a C function and ~10 us for a Python-level one (F.layer_norm,
  F.softmax, Tensor.split, ...), +10-20 % on such a step; a bare pass-through mode costs
  about as much. Spread over 16 steps it is ~1 %.
* Every step: one torch._foreach_norm over all gradients (~50-100 us in these steps, as
  _foreach_norm loops over the tensors on a CPU; one fused kernel on CUDA) and the Python of
  the handlers at backward (entry_points.py), the optimizer hooks, GradScaler bookkeeping
  and the step end: ~0.2 ms a step in all, which is what the "tiny" rows show.
* Every 32nd step the detailed gradient statistics (max, zeros, and fp16 underflow at the
  loss scale for the weight matrices: up to ~10 foreach passes, ~0.3-0.8 ms here); the
  "without grad stats" rows drop all gradient checks.
* Start-up: entering a guard imports and builds its monitors, AMP010 probes the autograd
  graph of the first backward passes and the first steps are watched: the "first steps"
  column, a one-time cost.
In the compute-bound shape the guard is noise, and trace="always" pays one max-|x|
reduction (abs().amax() on CPU) plus ~3 us of Python per checked output.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        head_width = width // self.heads
        q, k, v = (t.view(batch, length, self.heads, head_width).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_width)
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab, width, heads, layers, length):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass(frozen=True)
class Shape:
    name: str
    width: int
    heads: int
    layers: int
    length: int
    batch: int
    vocab: int = 256


_COMPUTE = Shape("compute", width=128, heads=4, layers=2, length=64, batch=8)
_HOST = Shape("host", width=32, heads=2, layers=2, length=64, batch=8)
_TINY = Shape("tiny", width=32, heads=2, layers=2, length=32, batch=8)
#: Per shape, the model size for each precision. fp16 matmul is ~10x slower than fp32 and
#: bf16 on this CPU: smaller fp16 sizes keep each shape's step time in the same range.
SHAPES = {
    "compute": {
        torch.float32: _COMPUTE,
        torch.bfloat16: _COMPUTE,
        torch.float16: Shape("compute", width=128, heads=4, layers=1, length=32, batch=4),
    },
    "host": {
        torch.float32: _HOST,
        torch.bfloat16: _HOST,
        torch.float16: Shape("host", width=32, heads=2, layers=2, length=32, batch=4),
    },
    "tiny": {
        torch.float32: _TINY,
        torch.bfloat16: _TINY,
        torch.float16: Shape("tiny", width=32, heads=2, layers=2, length=16, batch=2),
    },
}
#: Steps each variant runs before it is timed: a guard's first steps are all watched and
#: AMP010 probes the autograd graph of the first backward passes; that start-up is shown in
#: its own column, the per-step figure is the steady state of a long run.
WARMUP_STEPS = 10
#: Timed steps per variant and repetition: 32, so that the timed steps hold the steady-state
#: shares of watched steps (one in Thresholds.watch_every=16) and of detailed gradient
#: statistics (one step in 32).
TIMED_STEPS = 32
#: Repetitions per shape: the short steps get more, as this machine's speed drifts by a few
#: percent within a second and medians of more samples are steadier.
REPETITIONS = {"compute": 15, "host": 40, "tiny": 40}


class Trainer:
    """One model, optimizer and (for fp16) GradScaler; ``step()`` is one training step."""

    def __init__(self, shape: Shape, dtype: torch.dtype):
        torch.manual_seed(0)
        self.shape, self.dtype = shape, dtype
        self.model = TinyGPT(shape.vocab, shape.width, shape.heads, shape.layers, shape.length)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
        generator = torch.Generator().manual_seed(0)
        size = (shape.batch, shape.length + 1)
        self.batch = torch.randint(shape.vocab, size, generator=generator)

    def step(self) -> None:
        idx, target = self.batch[:, :-1], self.batch[:, 1:]
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()


VARIANTS = {
    "no guard": lambda: contextlib.nullcontext(),
    'trace="off"': lambda: amp_runtime.guard(policy="record", trace="off"),
    'trace="auto" (healthy)': lambda: amp_runtime.guard(policy="record", trace="auto"),
    'trace="auto" without replay': lambda: amp_runtime.guard(  # no root-module calls kept
        policy="record", trace="auto", ignore=["AMP101", "AMP103"]),
    'trace="auto" without grad stats': lambda: amp_runtime.guard(
        policy="record", trace="auto", ignore=["AMP103", "AMP104", "AMP105", "AMP106"]),
    'trace="always"': lambda: amp_runtime.guard(policy="record", trace="always"),
    "detect_anomaly()": lambda: torch.autograd.detect_anomaly(check_nan=True),
}


@dataclass
class Result:
    seconds: float  # median CPU seconds per step in steady state
    ratio: float  # median over repetitions of (this variant / no guard) in steady state
    startup_ratio: float  # the same over the warm-up steps
    events: int


def measure(trainer: Trainer, repetitions: int, steps: int) -> dict:
    """One Result per variant. The variants run one after the other in each repetition (in a
    rotating order), and each ratio compares runs of the same repetition, a second or so apart:
    drift of the machine's speed over the run cancels out."""
    names = list(VARIANTS)
    steady = {name: [] for name in names}
    startup = {name: [] for name in names}
    events = {name: 0 for name in names}
    for repetition in range(repetitions):
        order = names[repetition % len(names):] + names[: repetition % len(names)]
        for name in order:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # detect_anomaly announces itself
                context = VARIANTS[name]()
            gc.collect()  # every variant starts with the same garbage to collect: none
            start = time.process_time()
            with context as guard:
                for _ in range(WARMUP_STEPS):
                    trainer.step()
                warm = time.process_time()
                for _ in range(steps):
                    trainer.step()
                steady[name].append((time.process_time() - warm) / steps)
            startup[name].append((warm - start) / WARMUP_STEPS)
            if isinstance(guard, amp_runtime.Guard):
                events[name] += len(guard.report)
    baseline, baseline_startup = steady[names[0]], startup[names[0]]
    return {
        name: Result(
            seconds=statistics.median(steady[name]),
            ratio=statistics.median(a / b for a, b in zip(steady[name], baseline)),
            startup_ratio=statistics.median(a / b for a, b in zip(startup[name], baseline_startup)),
            events=events[name],
        )
        for name in names
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (rougher numbers)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU time per step after {WARMUP_STEPS} warm-up steps "
          f"(first steps: the warm-up); medians of alternated runs (compute: 15, host and tiny: "
          f"40; a third with --quick), ratios taken within each run\n")
    print("| shape | precision | variant | ms/step | × no guard | first steps × no guard "
          "| events |")
    print("|---|---|---|---|---|---|---|")
    for shape_name in options.shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            used = SHAPES[shape_name][dtype]
            repetitions = REPETITIONS[shape_name] // (3 if options.quick else 1)
            results = measure(Trainer(used, dtype), repetitions, TIMED_STEPS)
            for name, result in results.items():
                label = f"{shape_name} (d={used.width}, {used.layers}x{used.length}x{used.batch})"
                precision = str(dtype).replace("torch.", "")
                shown_events = result.events if name.startswith("trace") else "-"
                print(f"| {label} | {precision} | {name} | {result.seconds * 1e3:.2f} "
                      f"| {result.ratio:.3f} | {result.startup_ratio:.2f} "
                      f"| {shown_events} |", flush=True)


if __name__ == "__main__":
    main()
