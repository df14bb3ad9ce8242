"""EXPECT: AMP101, AMP112, AMP108, AMP107
MAY: AMP102, AMP104
FAULT: LayerNorm-free residual stream. The stream after the deepest block grows from ~1e3 at
step 0 to ~64000 at step 30 (measured with --plain); at step 31 the fp16 output of the deepest
block's MLP, `linear` in blocks.9.fc2 (the line `x = x + self.fc2(F.gelu(self.fc1(x)))`),
first holds inf while its inputs are finite, and it does so on every later step (the
GradScaler skips them, so the weights never move back). Expected: AMP101 at step 31, op
linear, module blocks.9.fc2, that line (found by the replay of the skipped step); AMP112 at
step 31 (the loss is NaN at backward, line of `scaler.scale(loss).backward()`), repeating;
AMP108 once the scale keeps falling (5 consecutive decreases 31..35, or below 65536/100 at
step 34 with 512); AMP107 at step 43, where the scale reaches 1 and keeps falling.
AMP102 may show once per-op checks are on (the same op's finite values reach 65472-65504).
Before the fault: scale settles 65536 -> 4096 in steps 0-4 (backward overflow while it
settles, not an event per AMP108's page); unscaled grad norm stays < 97, so no AMP104.
The run is chaotic in fp16: on another CPU (its fp16 kernels round differently) --plain shows
the stream crossing 65504 at step 20 and unscaled grad norms of 134 and 241 at steps 6 and 17
before it, which AMP104 reports as it should; so AMP104 is open.

A small time-series transformer (10 blocks, d=32) trained in fp16 autocast with a GradScaler.
Someone removed the per-block pre-LayerNorm "for speed" and kept only the final LayerNorm in
front of the head; the branches keep a fixed init std of 0.175 (no 1/sqrt(depth) scaling).
Without a norm inside the blocks nothing bounds the residual stream: it grows geometrically
with depth and, as AdamW enlarges the weights, the deep blocks' stream crosses fp16's 65504.
The stream itself is fp32 (learned positional embedding, fp32 + fp16 -> fp32), so what
overflows is the first fp16 op that reads the stream in the deepest block.
"""
import argparse
import json
import math
import os
import struct
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

torch.set_num_threads(1)   # small scenario; deterministic and stable timings on a shared 2-core machine

SEED, STEPS, D, HEADS, DEPTH, T, B, C = 0, 60, 32, 4, 10, 16, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        for m in (self.fc1, self.fc2, self.proj):
            nn.init.normal_(m.weight, std=0.175)
            nn.init.zeros_(m.bias)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(a)                      # no LayerNorm before attention ...
        x = x + self.fc2(F.gelu(self.fc1(x)))     # ... nor before the MLP
        return x


class SeriesTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.pos = nn.Parameter(torch.zeros(1, T, D))
        self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(D)               # the only norm left
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = self.embed(x) + self.pos
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h.mean(1)))


def make_batches():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, C, generator=g)
    out = []
    for _ in range(STEPS):
        x = torch.randn(B, T, 8, generator=g)
        out.append((x, (x.mean(1) @ w).argmax(-1)))
    return out


def train(guarded, probe=None):
    torch.manual_seed(SEED)
    model = SeriesTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")
    batches = make_batches()
    losses, scales = [], []
    if guarded:
        import amp_runtime
        ctx = amp_runtime.guard(policy="record", model=model)
    else:
        ctx = nullcontext()
    t0 = time.time()
    with ctx as g:
        for step, (x, y) in enumerate(batches):
            with (probe.trace(step, model) if probe else nullcontext()):
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(x)
                    loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if probe:
                probe.after_backward(step, model, loss, scaler)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "weights": snapshot(model), "guard": g, "time": time.time() - t0}


class Probe:
    """--plain: per-step loss, scale, unscaled grad norm, the stream's peak after blocks 6-9,
    and per step the first op whose output is non-finite while its inputs were finite."""

    def __init__(self):
        self.peaks, self.tracer, self.hooks = [], None, None

    def trace(self, step, model):
        if self.hooks is None:
            self.hooks = [blk.register_forward_hook(lambda m, i, o: self.peaks.append(float(o.detach().float().abs().max())))
                          for blk in model.blocks]
        self.peaks = []
        self.tracer = OpTracer(model)
        return self.tracer

    def after_backward(self, step, model, loss, scaler):
        self.tracer.remove()
        s = scaler.get_scale()
        gn = float(torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None]).norm()) / s
        print(f"step {step:2d} loss {loss.item():8.4g} scale {s:9.4g} unscaled grad norm {gn:9.4g} "
              f"stream peak after blocks 6-9 {[f'{v:.0f}' for v in self.peaks[-4:]]}")
        if self.tracer.first:
            print(f"        first non-finite op: {self.tracer.first}")
        if self.tracer.near:
            print(f"        fp16 outputs > 60000: {self.tracer.near[:3]}")


def plain():
    res = train(guarded=False, probe=Probe())
    bad = [i for i, v in enumerate(res["losses"]) if not math.isfinite(v)]
    fell = [i for i in range(len(res["scales"])) if res["scales"][i] < (res["scales"][i - 1] if i else 65536.0)]
    print("non-finite losses at steps", bad)
    print("steps the scaler skipped (scale fell):", fell)
    print("final scale", res["scales"][-1])


# ---------------------------------------------------------------- harness (same in every s13 script)
HERE = os.path.abspath(__file__)


class OpTracer(TorchFunctionMode):
    """Plain-torch diagnostic for --plain: the first op whose output holds NaN/Inf while its
    floating inputs were finite, and fp16 outputs above 60000 (module path + line of this file)."""

    def __init__(self, model, near=60000.0):
        super().__init__()
        self.stack, self.first, self.near, self.limit = [], None, [], near
        self.handles = []
        for name, mod in model.named_modules():
            name = name or "<root>"
            self.handles.append(mod.register_forward_pre_hook(lambda m, i, n=name: self.stack.append(n)))
            self.handles.append(mod.register_forward_hook(lambda m, i, o: self._pop()))

    def _pop(self):
        self.stack.pop()  # returns None: a forward hook's return value would replace the output

    def remove(self):
        for h in self.handles:
            h.remove()

    def _where(self):
        f = sys._getframe(3)
        while f is not None and os.path.abspath(f.f_code.co_filename) != HERE:
            f = f.f_back
        return f"{os.path.basename(HERE)}:{f.f_lineno}" if f else "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with torch.no_grad():
            self._check(func, args, kwargs, out)
        return out

    def _check(self, func, args, kwargs, out):
        fl = lambda xs: [t for t in tree_leaves(xs) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        outs = fl(out)
        if outs:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            mod = self.stack[-1] if self.stack else "-"
            if self.first is None and not all(bool(torch.isfinite(t).all()) for t in outs):
                if all(bool(torch.isfinite(t).all()) for t in fl((args, kwargs))):
                    self.first = (name, mod, self._where(), [str(t.dtype) for t in outs])
            for t in outs:
                if t.dtype == torch.float16:
                    peak = float(torch.nan_to_num(t.abs(), nan=0.0, posinf=0.0).max())
                    if peak > self.limit:
                        self.near.append((name, mod, self._where(), peak))


def _fkey(x):
    return "nan" if x is None or math.isnan(x) else struct.pack("<d", float(x))


def same_floats(a, b):
    return len(a) == len(b) and all(_fkey(x) == _fkey(y) for x, y in zip(a, b))


def same_tensor(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.equal(a[~na].contiguous().view(ints[a.dtype]), b[~nb].contiguous().view(ints[b.dtype]))


def snapshot(*modules):
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}


def compare_and_report(ref, got, g):
    lm, sm = same_floats(ref["losses"], got["losses"]), same_floats(ref["scales"], got["scales"])
    wm = ref["weights"].keys() == got["weights"].keys() and all(
        same_tensor(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    print(f"LOSSES_MATCH {lm and sm} (losses {lm}, loss scales {sm}; {len(ref['losses'])} loss values)")
    print(f"WEIGHTS_MATCH {wm}")
    print(f"time: unguarded {ref['time']:.2f}s, guarded {got['time']:.2f}s")
    for e in g.report.events:
        print(f"EVENT {e.code} {e.severity} step={e.step} module={e.module} op={e.op} line={e.source}")
        print(f"    message: {e.message}")
        d = e.details or {}
        keep = {k: d[k] for k in ("replayed", "call", "calls", "origin", "replay", "max", "scale", "fraction") if k in d}
        if keep:
            print("    details:", json.dumps(keep, default=str)[:700])
    counts = g.report.to_json().get("counts", {})
    print("COUNTS", json.dumps(counts, sort_keys=True))
    print("EVENTS", json.dumps(sorted({e.code for e in g.report.events})))


def main(train, plain):
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true", help="check the fault with plain torch only")
    a = ap.parse_args()
    if a.plain:
        plain()
        return
    ref = train(guarded=False)
    got = train(guarded=True)
    compare_and_report(ref, got, got["guard"])

if __name__ == "__main__":
    main(train, plain)
