"""EXPECT: AMP105, AMP101, AMP112, AMP108
MAY: AMP102, AMP106
FAULT: weight growth from a sign error in hand-written weight decay (`p.add_(p, alpha=WD)`,
line 98). Measured with --plain: each weight matrix's norm grows 1.04x per step (6.8 -> 141
for the first layer); the logits saturate, the fp32 cross-entropy reaches exactly 0 and the
unscaled gradient norm falls to 7.6e-6 at step 29 and 0 from step ~31 on (vanishing);
scaled-backward overflows make the GradScaler skip steps 45, 57, 59; the peak output of the
last Linear (layers.6, the logits) reaches 57,800 at step 69 and from step 71 on that fp16
`linear` produces inf from finite inputs on every step (the decay keeps growing the weights
even on skipped steps). Expected: AMP105 around steps 29-31 (total norm < 1e-6, the whole
model); AMP101 at step 71, op linear, module layers.6, line 57 (`return self.layers(x)`:
the Sequential is called there); AMP112 from step 71 on (loss NaN); AMP108 at step 74
(scale 512 < 65536/100) or 75 (5 consecutive decreases 71-75). The scale ends at 16: no
AMP107. AMP102 may show for layers.6 (62,000-65,400 on steps 69-79) if per-op checks are on;
AMP106 may show on step 32 or 64. Nothing names the real bug (the decay line 98): the
events can only point at its effect, the growing layers.

An MLP classifier trained in fp16 autocast with a GradScaler and Adam (weight_decay=0). The
script applies decoupled weight decay by hand after the optimizer step, to the Linear
weights only ("no decay for biases"), and gets the sign wrong: `p.add_(p, alpha=WD)` where
it meant `alpha=-WD`. Every step multiplies each weight matrix by 1.04 (also on steps the
GradScaler skips, since the decay runs outside scaler.step), so activations grow ~1.04^4
per step through the four layers until an fp16 matmul overflows late in the run.
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

SEED, STEPS, FEATS, HID, B, CLASSES = 0, 80, 64, 128, 64, 10
LR, WD = 1e-3, 0.04


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(FEATS, HID), nn.ReLU(),
            nn.Linear(HID, HID), nn.ReLU(),
            nn.Linear(HID, HID), nn.ReLU(),
            nn.Linear(HID, CLASSES),
        )

    def forward(self, x):
        return self.layers(x)


def make_batches():
    g = torch.Generator().manual_seed(1)
    protos = torch.randn(CLASSES, FEATS, generator=g)
    out = []
    for _ in range(STEPS):
        y = torch.randint(0, CLASSES, (B,), generator=g)
        out.append((protos[y] + torch.randn(B, FEATS, generator=g), y))
    return out


def train(guarded, probe=None):
    torch.manual_seed(SEED)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    batches = make_batches()
    losses, scales = [], []
    if guarded:
        import amp_runtime
        ctx = amp_runtime.guard(policy="record")
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
            with torch.no_grad():
                for p in decay:
                    p.add_(p, alpha=WD)          # BUG: decoupled weight decay with the wrong sign (-WD)
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "weights": snapshot(model), "guard": g, "time": time.time() - t0}


class Probe:
    def __init__(self):
        self.tracer, self.peaks, self.hooks = None, [], None

    def trace(self, step, model):
        if self.hooks is None:
            self.hooks = [m.register_forward_hook(lambda m, i, o: self.peaks.append(float(o.detach().float().abs().max())))
                          for m in model.layers if isinstance(m, nn.Linear)]
        self.peaks = []
        self.tracer = OpTracer(model)
        return self.tracer

    def after_backward(self, step, model, loss, scaler):
        self.tracer.remove()
        s = scaler.get_scale()
        gn = float(torch.stack([p.grad.float().norm() for p in model.parameters()]).norm()) / s
        wn = [round(float(m.weight.norm()), 1) for m in model.layers if isinstance(m, nn.Linear)]
        print(f"step {step:2d} loss {loss.item():9.4g} scale {s:8.4g} unscaled grad norm {gn:9.4g} "
              f"|W| {wn} peak |out| per linear {[f'{v:.3g}' for v in self.peaks]}")
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
