"""EXPECT: AMP112
MAY: none
FAULT: NaN in the input data. The batch of step 29 holds NaN at row 77, feature 4; the first
op of the model (linear in `inp`) receives it, so every op only propagates a NaN that was
already there: no op turns finite inputs non-finite (measured with --plain: the op tracer
finds none). The loss is NaN at step 29 only, the GradScaler skips that one step (scale
65536 -> 32768), training goes on and ends with finite weights. Expected: AMP112 at step 29,
at the line `scaler.scale(loss).backward()`, whose replay finds no op and no non-finite
parameter, so its message should point at the data (the model's input / the loss's inputs),
not at an op. No AMP101 (that would blame `linear` in `inp` for a NaN it was given), no
AMP103 (the scaler skips the step), no AMP108 (one decrease).

A tabular classifier (MLP with LayerNorm and dropout) trained in fp16 autocast with a
GradScaler, AdamW and a cosine schedule. The features come from a join against a table in
which one customer has a missing value: the loader turns it into NaN, and nothing checks.
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

SEED, STEPS, FEATS, HID, B, CLASSES = 0, 60, 20, 64, 128, 3
NAN_STEP, NAN_ROW, NAN_COL = 29, 77, 4


class TabularMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(FEATS, HID)
        self.block = nn.Sequential(nn.LayerNorm(HID), nn.GELU(), nn.Dropout(0.1), nn.Linear(HID, HID))
        self.out = nn.Sequential(nn.LayerNorm(HID), nn.GELU(), nn.Linear(HID, CLASSES))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.block(h)
        return self.out(h)


def make_batches():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(FEATS, CLASSES, generator=g)
    out = []
    for step in range(STEPS):
        x = torch.randn(B, FEATS, generator=g)
        y = (x @ w + 0.3 * torch.randn(B, CLASSES, generator=g)).argmax(-1)
        if step == NAN_STEP:
            x[NAN_ROW, NAN_COL] = float("nan")      # the missing value, read as NaN
        out.append((x, y))
    return out


def train(guarded, probe=None):
    torch.manual_seed(SEED)
    model = TabularMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
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
                probe.after_backward(step, model, loss, scaler, x)
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "weights": snapshot(model), "guard": g, "time": time.time() - t0}


class Probe:
    def __init__(self):
        self.tracer = None

    def trace(self, step, model):
        self.tracer = OpTracer(model)
        return self.tracer

    def after_backward(self, step, model, loss, scaler, x):
        self.tracer.remove()
        if step in (0, NAN_STEP - 1, NAN_STEP, NAN_STEP + 1, STEPS - 1) or not math.isfinite(loss.item()):
            nan_in = torch.isnan(x).nonzero().tolist()
            print(f"step {step:2d} loss {loss.item():8.4g} scale {scaler.get_scale():8.4g} NaN in input at {nan_in} "
                  f"first op with non-finite output from finite inputs: {self.tracer.first}")


def plain():
    res = train(guarded=False, probe=Probe())
    bad = [i for i, v in enumerate(res["losses"]) if not math.isfinite(v)]
    fell = [i for i in range(len(res["scales"])) if res["scales"][i] < (res["scales"][i - 1] if i else 65536.0)]
    print("non-finite losses at steps", bad, "; steps the scaler skipped:", fell, "; final scale", res["scales"][-1])
    print("weights finite at the end:", all(bool(torch.isfinite(v).all()) for v in res["weights"].values()))


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
