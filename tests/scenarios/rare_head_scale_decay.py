"""EXPECT: AMP108, AMP104
MAY: AMP106
FAULT: intermittent backward overflow in a rarely-used head. On every duration batch (steps
6, 13, 20, ..., 69) the scaled gradients of duration_head (and, while the scale is high, of
the trunk) overflow fp16 in the backward; the forward and the loss (~1.3e6, fp32) are finite.
The GradScaler skips those ten steps and halves the scale each time: 65536 -> 64 by step 69
(measured with --plain; growth_interval 2000 never lets it grow back). At step 76 the scale
(64) is finally low enough, the step goes through, and its unscaled gradient norm is 1449.
Expected: AMP108 at step 48 (scale 512, below 65536/100) and/or step 69 (64, below 128 and
falling); the ideal message names duration_head (duration_head.2, the head's last linear, is
the last layer still overflowing) as where skipped steps overflow, though the overflow only
happens with the loss scale applied, so a replay without it may not reproduce it; AMP104 at
step 76 (unscaled total norm 1449 > 1000, P0). No AMP101/AMP112 (forward and loss finite),
no AMP103 (the skipped steps are not applied), no AMP107 (scale stays at 64), no AMP109
(its 100-step window is never full in 80 steps). AMP106 may show on a 32nd step at scale
128-256 if the churn head's small gradients start to flush.

A multi-task tabular model trained in fp16 autocast with a GradScaler: a shared MLP trunk,
a churn-classification head used on every batch, and a rarely-used "time to churn" head
whose label exists only for one batch in seven (steps 6, 13, 20, ...). Its regression
target is in raw seconds (2000-5000 s): nobody normalised it, since the head is rarely
used. MSE on those targets gives gradients in the thousands at the head; multiplied by
the loss scale they overflow fp16 in the backward, every time the head is used.
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

SEED, STEPS, FEATS, HID, B = 0, 80, 32, 128, 64
AUX_EVERY = 7              # the duration label exists for steps 6, 13, 20, ...


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(FEATS, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU())
        self.churn_head = nn.Linear(HID, 2)
        self.duration_head = nn.Sequential(nn.Linear(HID, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, with_duration=False):
        h = self.trunk(x)
        logits = self.churn_head(h)
        if not with_duration:
            return logits, None
        return logits, self.duration_head(h).squeeze(-1)


def make_batches():
    g = torch.Generator().manual_seed(1)
    w, v = torch.randn(FEATS, generator=g), torch.randn(FEATS, generator=g) / FEATS ** 0.5
    out = []
    for step in range(STEPS):
        x = torch.randn(B, FEATS, generator=g)
        churn = (x @ w + 0.5 * torch.randn(B, generator=g) > 0).long()
        dur = 3500.0 + 1500.0 * torch.tanh(x @ v) if step % AUX_EVERY == AUX_EVERY - 1 else None
        out.append((x, churn, dur))
    return out


def train(guarded, probe=None):
    torch.manual_seed(SEED)
    model = MultiTaskNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    batches = make_batches()
    losses, scales = [], []
    if guarded:
        import amp_runtime
        ctx = amp_runtime.guard(policy="record")
    else:
        ctx = nullcontext()
    t0 = time.time()
    with ctx as g:
        for step, (x, churn, dur) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                logits, dur_pred = model(x, with_duration=dur is not None)
                loss = F.cross_entropy(logits, churn)
                if dur is not None:
                    loss = loss + 0.1 * F.mse_loss(dur_pred.float(), dur)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if probe:
                probe.after_backward(step, model, loss, scaler, dur is not None)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "weights": snapshot(model), "guard": g, "time": time.time() - t0}


class Probe:
    def after_backward(self, step, model, loss, scaler, aux):
        s = scaler.get_scale()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        fin = [p.grad.float() / s for p in model.parameters() if p.grad is not None]
        gn = float(torch.stack([x.norm() for x in fin]).norm())
        peak = max(float(p.grad.float().abs().max()) for p in model.parameters() if p.grad is not None)
        tiny = [(n, float((p.grad != 0).float().mean())) for n, p in model.named_parameters()
                if p.grad is not None and p.dim() == 2]
        print(f"step {step:2d} {'AUX ' if aux else '    '}loss {loss.item():10.4g} scale {s:8.4g} "
              f"unscaled grad norm {gn:9.4g} peak |scaled grad| {peak:9.4g} non-finite grads in {bad}")


def plain():
    res = train(guarded=False, probe=Probe())
    fell = [i for i in range(len(res["scales"])) if res["scales"][i] < (res["scales"][i - 1] if i else 65536.0)]
    print("steps the scaler skipped (scale fell):", fell)
    print("final scale", res["scales"][-1])
    # the same head's gradient without any loss scale, at the first aux step: does it overflow fp16 by itself?
    torch.manual_seed(SEED)
    model = MultiTaskNet()
    x, churn, dur = make_batches()[AUX_EVERY - 1]
    with torch.autocast("cpu", dtype=torch.float16):
        logits, dur_pred = model(x, with_duration=True)
        loss = F.cross_entropy(logits, churn) + 0.1 * F.mse_loss(dur_pred.float(), dur)
    loss.backward()
    print("unscaled backward at step 6: max |grad| per parameter",
          {n: round(float(p.grad.abs().max()), 1) for n, p in model.named_parameters()})


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
