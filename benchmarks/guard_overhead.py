"""Overhead of amp_runtime.guard on GPT-style training steps, on a CUDA GPU or the CPU.

    python benchmarks/guard_overhead.py                     # CUDA when available, else the CPU
    python benchmarks/guard_overhead.py --device cuda       # GPT-2-124M-shaped and host-bound steps
    python benchmarks/guard_overhead.py --device cpu --quick --repetitions 3   # a quick look
    python benchmarks/guard_overhead.py --variants auto always   # fewer variants, more repetitions

CUDA shapes: "gpt2-124m" (12 layers, d=768, T=1024, batch 8, vocabulary 50304, tied embedding,
scaled-dot-product attention: GPU-bound on an H100, ~30 ms a step) and "host" (4 layers, d=256,
T=256, batch 16: host-bound, ~11 ms, where Python time per step shows). Each in fp16 with a
GradScaler and in bf16, fused AdamW, clip_grad_norm_, GPT-2's initialisation (nanoGPT's recipe).

CPU shapes: "compute" (d=128, matmul-bound), "host" (d=32, ~8 ms a step: kernels are fast and
Python time per op is what shows, the CPU's proxy for a GPU) and "tiny" (d=32, ~4 ms: harsher
still), in fp32, bf16 and fp16 (with a GradScaler), AdamW.

Variants alternate within one process (in a rotating order) so that drift hits all of them
alike. Columns: the median time per step in steady state (wall time between device syncs on
CUDA, CPU time on the CPU), the median of its ratio to the unguarded step of the same repetition,
the same ratio over the warm-up steps (a guard's start-up), on CUDA the host syncs per steady
step (``torch.cuda.set_sync_debug_mode("warn")`` counting synchronising calls, in the first
repetition) and the peak memory allocated, and the events the guard recorded.

What the guard costs per step, by design (``amp_runtime/readings.py``): the step-level statistics
(the loss, gradient norms, the loss scale; AMP106's counts every 32nd step) are computed on the
device and copied to pinned host memory without a sync, one small buffer at the optimizer step
and one at the GradScaler's update, and judged when the copy has arrived: no host sync is added
to a steady step. The rest is Python: the handlers where backward starts (``entry_points.py``),
the optimizer hooks, the GradScaler bookkeeping, one fused ``torch._foreach_norm`` over the
gradients, the step end (together ~0.1-0.2 ms, which the host-bound shapes show), and on watched
steps (the first 8, then one in 16) the TorchFunctionMode's dispatch of every torch call (~1 us
for a C function, ~10 us for a Python-level one). ``trace="always"`` adds per checked op a
max-|x| reduction of its output (and of inputs no traced op produced) kept on the device, and a
short stack walk naming its module and line; the step's peaks are read in the same buffer.
Start-up: entering a guard imports and builds its monitors, AMP010 probes the autograd graph of
the first backward passes and the first steps are watched (the "first steps" column).
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
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime


class Attention(nn.Module):
    def __init__(self, width, heads, fused):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        head_width = width // self.heads
        q, k, v = (t.view(batch, length, self.heads, head_width).transpose(1, 2) for t in (q, k, v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_width)
            mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width, heads, fused):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, fused)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation (as nanoGPT's): weights N(0, 0.02), biases zero. PyTorch's default
    N(0, 1) embedding, tied to the head, gives logits of spread ~sqrt(width) and a softmax so
    peaked that its raw gradient norm climbs past 100 within a few dozen steps on one batch."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(nn.Module):
    def __init__(self, shape: "Shape"):
        super().__init__()
        self.tokens = nn.Embedding(shape.vocab, shape.width)
        self.positions = nn.Embedding(shape.length, shape.width)
        self.blocks = nn.ModuleList(
            Block(shape.width, shape.heads, shape.fused_attention) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab, bias=not shape.tied)
        if shape.tied:
            self.head.weight = self.tokens.weight
            self.apply(_gpt2_init)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
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
    #: GPT-2's choices: scaled-dot-product attention, the head tied to the token embedding (with
    #: GPT-2's initialisation), gradients clipped to norm 1 (the CPU shapes keep the step their
    #: README rows measured).
    fused_attention: bool = False
    tied: bool = False
    clip: bool = False

    def label(self) -> str:
        return f"{self.name} (d={self.width}, {self.layers}x{self.length}x{self.batch})"


_COMPUTE = Shape("compute", width=128, heads=4, layers=2, length=64, batch=8)
_HOST = Shape("host", width=32, heads=2, layers=2, length=64, batch=8)
_TINY = Shape("tiny", width=32, heads=2, layers=2, length=32, batch=8)
_GPT2 = Shape("gpt2-124m", width=768, heads=12, layers=12, length=1024, batch=8, vocab=50304,
              fused_attention=True, tied=True, clip=True)
_GPU_HOST = Shape("host", width=256, heads=4, layers=4, length=256, batch=16, vocab=4096,
                  fused_attention=True, tied=True, clip=True)
#: Per device and shape, the model size for each precision. On the CPU fp16 matmul is ~10x
#: slower than fp32 and bf16: smaller fp16 sizes keep each shape's step time in the same range.
SHAPES: Dict[str, Dict[str, Dict[torch.dtype, Shape]]] = {
    "cpu": {
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
    },
    "cuda": {
        "gpt2-124m": {torch.float16: _GPT2, torch.bfloat16: _GPT2},
        "host": {torch.float16: _GPU_HOST, torch.bfloat16: _GPU_HOST},
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
#: Steps run under torch.cuda's sync debug mode to count host syncs (first repetition only).
SYNC_COUNT_STEPS = 16
#: Repetitions per shape: the short steps get more, as a machine's speed drifts by a few
#: percent within a second and medians of more samples are steadier.
REPETITIONS = {"compute": 15, "host": 40, "tiny": 40, "gpt2-124m": 10}


class Trainer:
    """One model, optimizer and (for fp16) GradScaler on a device; ``step()`` is one step."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: str):
        torch.manual_seed(0)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.model = TinyGPT(shape).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4,
                                           fused=device == "cuda")
        self.scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None
        generator = torch.Generator().manual_seed(0)
        size = (shape.batch, shape.length + 1)
        self.batch = torch.randint(shape.vocab, size, generator=generator).to(device)

    def step(self) -> None:
        idx, target = self.batch[:, :-1], self.batch[:, 1:]
        with torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            self._clip()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            if self.shape.clip:
                self.scaler.unscale_(self.optimizer)
            self._clip()
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def _clip(self) -> None:
        if self.shape.clip:
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


#: The baseline, then the variants compared with it (``--variants`` names them by key).
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
VARIANT_KEYS = dict(zip(
    ["off", "auto", "auto-no-replay", "auto-no-grad-stats", "always", "anomaly"],
    list(VARIANTS)[1:]))


@dataclass
class Result:
    seconds: float  # median seconds per step in steady state
    ratio: float  # median over repetitions of (this variant / no guard) in steady state
    startup_ratio: float  # the same over the warm-up steps
    events: int
    syncs: Optional[float] = None  # host syncs per steady step (CUDA)
    peak_mib: Optional[float] = None  # peak memory allocated (CUDA)


@contextlib.contextmanager
def sync_debug_mode(on_sync: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``on_sync()`` runs at each synchronising CUDA call (where torch.cuda's
    sync debug mode warns, not at the mode's own notice that it is a prototype)."""

    def show(message, *args, **kwargs):
        text = str(message)
        if "synchroniz" in text and "prototype" not in text:
            on_sync()

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def count_syncs(trainer: Trainer, steps: int) -> float:
    """Synchronising CUDA calls per step, as torch.cuda's sync debug mode reports them."""
    syncs: List[None] = []
    trainer.sync()
    with sync_debug_mode(lambda: syncs.append(None)):
        for _ in range(steps):
            trainer.step()
    trainer.sync()
    return len(syncs) / steps


def measure(trainer: Trainer, repetitions: int, steps: int,
            names: List[str]) -> Dict[str, Result]:
    """One Result per variant of ``names`` (the baseline first). The variants run one after the
    other in each repetition (in a rotating order), and each ratio compares runs of the same
    repetition, a second or so apart: drift of the machine's speed over the run cancels out."""
    cuda = trainer.device == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    steady: Dict[str, List[float]] = {name: [] for name in names}
    startup: Dict[str, List[float]] = {name: [] for name in names}
    events = {name: 0 for name in names}
    syncs: Dict[str, float] = {}
    peak: Dict[str, float] = {}
    for repetition in range(repetitions):
        order = names[repetition % len(names):] + names[: repetition % len(names)]
        for name in order:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # detect_anomaly announces itself
                context = VARIANTS[name]()
            gc.collect()  # every variant starts with the same garbage to collect: none
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.sync()
            start = clock()
            with context as guard:
                for _ in range(WARMUP_STEPS):
                    trainer.step()
                trainer.sync()
                warm = clock()
                for _ in range(steps):
                    trainer.step()
                trainer.sync()
                steady[name].append((clock() - warm) / steps)
                if cuda and repetition == 0:
                    syncs[name] = count_syncs(trainer, SYNC_COUNT_STEPS)
            startup[name].append((warm - start) / WARMUP_STEPS)
            if cuda:
                peak[name] = max(peak.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**20)
            if isinstance(guard, amp_runtime.Guard):
                events[name] += len(guard.report)
    baseline, baseline_startup = steady[names[0]], startup[names[0]]
    return {
        name: Result(
            seconds=statistics.median(steady[name]),
            ratio=statistics.median(a / b for a, b in zip(steady[name], baseline)),
            startup_ratio=statistics.median(a / b for a, b in zip(startup[name], baseline_startup)),
            events=events[name],
            syncs=syncs.get(name),
            peak_mib=peak.get(name),
        )
        for name in names
    }


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cuda", "cpu"], default=default_device,
                        help=f"where to train (default: {default_device})")
    parser.add_argument("--shapes", nargs="+", help="shapes to run (default: all of the device's)")
    parser.add_argument("--quick", action="store_true", help="a third of the repetitions")
    parser.add_argument("--repetitions", type=_positive, help="repetitions per shape (overrides)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANT_KEYS), metavar="VARIANT",
                        help="variants to compare with the unguarded step (default: all of "
                             f"{', '.join(VARIANT_KEYS)})")
    options = parser.parse_args(argv)
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu)")
    shapes = SHAPES[options.device]
    unknown = sorted(set(options.shapes or ()) - set(shapes))
    if unknown:
        parser.error(f"--shapes: {', '.join(unknown)} not among {', '.join(shapes)} "
                     f"on {options.device}")
    if options.device == "cpu":
        torch.set_num_threads(1)  # steadier numbers
        where, clock = f"CPU, 1 intra-op thread, torch {torch.__version__}", "CPU time"
    else:
        where = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                 f"CUDA {torch.version.cuda}")
        clock = "wall time between device syncs"
    names = ["no guard"] + [VARIANT_KEYS[key] for key in options.variants or VARIANT_KEYS]
    print(f"{where}; {clock} per step after {WARMUP_STEPS} warm-up steps (first steps: the "
          f"warm-up); medians of alternated runs, ratios taken within each run\n")
    print("| shape | precision | variant | ms/step | × no guard | first steps × no guard "
          "| host syncs/step | peak MiB | events |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape_name in options.shapes or list(shapes):
        for dtype, used in shapes[shape_name].items():
            repetitions = options.repetitions or max(1, REPETITIONS[shape_name] // (
                3 if options.quick else 1))
            results = measure(Trainer(used, dtype, options.device), repetitions, TIMED_STEPS,
                              names)
            precision = str(dtype).replace("torch.", "")
            for name, result in results.items():
                shown_events = result.events if name.startswith("trace") else "-"
                print(f"| {used.label()} | {precision} | {name} | {result.seconds * 1e3:.2f} "
                      f"| {result.ratio:.3f} | {result.startup_ratio:.2f} "
                      f"| {_cell(result.syncs, 2)} | {_cell(result.peak_mib, 0)} "
                      f"| {shown_events} |", flush=True)


if __name__ == "__main__":
    main()
