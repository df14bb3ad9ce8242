"""EXPECT: none
MAY: none
FAULT: none (healthy but tricky). fp16 autocast with a GradScaler whose growth_interval is 10,
so the scale doubles every 10 good steps until the scaled gradients overflow, and the scaler
skips a step now and then: normal GradScaler operation. scaler.unscale_(opt) before
clip_grad_norm_(max_norm=1.0) (which does clip early on; on a skipped step it returns inf
and multiplies the inf gradients by 0, leaving NaN that scaler.step then skips), OneCycleLR
stepped every iteration, BatchNorm and Dropout, and an evaluation every 10 steps under
torch.inference_mode() with model.eval() and fp16 autocast, then back to model.train().

A small classifier on synthetic sensor features.
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

SEED, STEPS, FEATS, HID, B, CLASSES, EVAL_EVERY = 0, 80, 48, 96, 64, 5, 10


class SensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(FEATS, HID), nn.BatchNorm1d(HID), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(HID, HID), nn.BatchNorm1d(HID), nn.ReLU(), nn.Dropout(0.2),
        )
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(self.body(x))


def make_data():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(FEATS, CLASSES, generator=g)

    def batch():
        x = torch.randn(B, FEATS, generator=g)
        return x, (x @ w + 0.5 * torch.randn(B, CLASSES, generator=g)).argmax(-1)

    return [batch() for _ in range(STEPS)], [batch() for _ in range(4)]


@torch.inference_mode()
def evaluate(model, val):
    model.eval()
    tot_loss, correct, n = 0.0, 0, 0
    for x, y in val:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            tot_loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
        n += len(y)
    model.train()
    return tot_loss / n, correct / n


def train(guarded, probe=None):
    torch.manual_seed(SEED)
    model = SensorNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10)
    train_batches, val = make_data()
    losses, scales, evals = [], [], []
    if guarded:
        import amp_runtime
        ctx = amp_runtime.guard(policy="record", model=model)
    else:
        ctx = nullcontext()
    t0 = time.time()
    with ctx as g:
        for step, (x, y) in enumerate(train_batches):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            if probe:
                probe(step, loss, scaler, gnorm)
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            if (step + 1) % EVAL_EVERY == 0:
                evals.append(evaluate(model, val))
                losses.append(evals[-1][0])          # compared bit for bit too
    return {"losses": losses, "scales": scales, "weights": snapshot(model), "guard": g,
            "time": time.time() - t0, "evals": evals}


def plain():
    def probe(step, loss, scaler, gnorm):
        print(f"step {step:2d} loss {loss.item():7.4f} scale {scaler.get_scale():9.0f} grad norm (unscaled, before clip) {float(gnorm):9.4g}")

    res = train(guarded=False, probe=probe)
    fell = [i for i in range(len(res["scales"])) if res["scales"][i] < (res["scales"][i - 1] if i else 65536.0)]
    print("steps the scaler skipped (scale fell):", fell, "; final scale", res["scales"][-1])
    print("evaluations (val loss, accuracy):", [(round(a, 4), round(b, 3)) for a, b in res["evals"]])
    print("all losses finite:", all(math.isfinite(v) for v in res["losses"]))


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
