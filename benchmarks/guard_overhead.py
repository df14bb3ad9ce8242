"""Overhead of amp_runtime.guard on a small GPT-like training step (CPU).

    python benchmarks/guard_overhead.py            # full run
    python benchmarks/guard_overhead.py --quick    # fewer repetitions

Two shapes: "compute" (d=128, matmul-bound) and "host" (d=32, tiny: Python time per op
dominates, the better proxy for a GPU where kernels are fast). Precisions: fp32, and
bf16/fp16 autocast (fp16 with a GradScaler). Variants are alternated within one process
so that drift hits all of them alike; the table shows the median CPU time per step and
the ratio to the unguarded step. One intra-op thread keeps the numbers stable.

What dominates (profiled): in the host-bound shape, the TorchFunctionMode's own dispatch
of the forward pass -- every torch call and tensor attribute read from Python crosses into
the mode: ~74 per step in every precision (optimizer.step(), zero_grad() and GradScaler's
unscale_/step/update run unobserved; GradScaler's attribute reads were 250 more), ~1 us
each for a C function but ~10 us for the ~13 Python-level ones (F.layer_norm, F.softmax,
Tensor.split, Tensor.backward, ...), which go through torch's Python handle_torch_function.
That is a floor for any Python TorchFunctionMode over the forward pass: a bare pass-through
mode over forward and backward measured ~1.07-1.10x in the host fp32 shape. The guard's own
per-step Python (handlers, optimizer hooks, step end, judging the gradient norms) adds
~8-10k bytecodes to a step of ~14k; the gradient norms cost ~50 us of CPU kernels a step
(torch._foreach_norm is a per-tensor loop on CPU, one fused kernel on CUDA) plus a detailed
pass every 16th step (the "without grad stats" row drops them); and since every variant
enters a fresh guard, the measured steps include 7 of AMP010's 8 autograd-graph probes
(~0.2 ms each in fp32/bf16). In the compute-bound shape the mode is noise, and
trace="always" pays one max-|x| reduction (abs().amax() on CPU) plus ~3 us of Python per
checked output.
"""
from __future__ import annotations

import argparse
import contextlib
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


SHAPES = {
    "compute": Shape("compute", width=128, heads=4, layers=2, length=64, batch=8),
    "host": Shape("host", width=32, heads=2, layers=2, length=32, batch=8),
}
#: fp16 matmul is ~10x slower than fp32 and bf16 on this CPU: smaller fp16 shapes keep the run
#: short (the compute one is still matmul-bound, the host one still about 4 ms a step).
FP16_SHAPES = {
    "compute": Shape("compute", width=128, heads=4, layers=1, length=32, batch=4),
    "host": Shape("host", width=32, heads=2, layers=2, length=16, batch=2),
}
#: Steps each variant runs before it is timed: a guard's first steps are all watched and
#: AMP010 probes the autograd graph of the first backward passes; that start-up is shown in
#: its own column, the per-step figure is the steady state of a long run.
WARMUP_STEPS = 10
#: Timed steps per variant and repetition: a multiple of Thresholds.watch_every (16), so that
#: the timed steps hold the steady-state share of watched steps.
TIMED_STEPS = {"compute": 16, "host": 32}


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
    'trace="auto" without grad stats': lambda: amp_runtime.guard(
        policy="record", trace="auto", ignore=["AMP103", "AMP104", "AMP105", "AMP106"]),
    'trace="always"': lambda: amp_runtime.guard(policy="record", trace="always"),
    "detect_anomaly()": lambda: torch.autograd.detect_anomaly(check_nan=True),
}


def measure(trainer: Trainer, repetitions: int, steps: int) -> dict:
    """Per variant: median CPU seconds per step in steady state and over the warm-up steps, and
    the number of events; variants alternated per repetition."""
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
    return {name: (statistics.median(steady[name]), statistics.median(startup[name]), events[name])
            for name in names}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (rougher numbers)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    repetitions = 5 if options.quick else 15
    print(f"torch {torch.__version__}, CPU time per step after {WARMUP_STEPS} warm-up steps "
          f"(first steps: the warm-up), median of {repetitions} alternated runs\n")
    print("| shape | precision | variant | ms/step | × no guard | first steps × no guard "
          "| events |")
    print("|---|---|---|---|---|---|---|")
    for shape_name in options.shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            used = FP16_SHAPES[shape_name] if dtype == torch.float16 else SHAPES[shape_name]
            results = measure(Trainer(used, dtype), repetitions, TIMED_STEPS[shape_name])
            baseline, baseline_startup, _ = results["no guard"]
            for name, (seconds, startup, events) in results.items():
                label = f"{shape_name} (d={used.width}, {used.layers}x{used.length}x{used.batch})"
                precision = str(dtype).replace("torch.", "")
                shown_events = events if name.startswith("trace") else "-"
                print(f"| {label} | {precision} | {name} | {seconds * 1e3:.2f} "
                      f"| {seconds / baseline:.3f} | {startup / baseline_startup:.2f} "
                      f"| {shown_events} |", flush=True)


if __name__ == "__main__":
    main()
