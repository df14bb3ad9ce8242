"""EXPECT: none
MAY: none
FAULT: none (healthy but tricky). fp16 CPU autocast + GradScaler on a small CNN (Conv/BatchNorm/
ReLU, AdaptiveAvgPool2d, Dropout, Linear); SGD(momentum, nesterov, weight_decay) driven by
OneCycleLR (max_lr 0.1, stepped every iteration, momentum cycled too); loss
nn.CrossEntropyLoss(label_smoothing=0.1) on logits.float() inside the autocast block; the loop
calls scaler.unscale_(opt) (line 79) and then
torch.nn.utils.clip_grad_value_(..., clip_value=0.1) (line 84) before scaler.step(opt).
Measured in --plain: all 60 losses finite (2.39 -> ~1.0-1.2, train accuracy 0.06 -> ~0.9),
the scale stays at 65536 (no skipped step), unscaled max |grad| 0.07-0.20 and norms 0.7-1.2,
so the value clip bites on 25 of 60 steps (1-11 values each) - on unscaled grads, as it should.
Per the pages nothing should be reported: no AMP005 (unscale_ came first; clip_grad_value_ is
covered by the rule and must be recognised as clipping unscaled grads), no AMP006 (scaler.step
then scaler.update every step), no AMP004 (pooling is adaptive_avg_pool2d, the loss gets fp32
logits), no AMP002, no AMP104-AMP106 (norms ~1, scale 65536, no layer dead), no AMP108/109.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

# -- the shared driver of this batch's scenarios, inlined --------------------------------
import json
import math
import struct
import sys

import torch

torch.set_num_threads(1)


def bits_equal(a, b):
    """Bit-for-bit equality of two tensors; NaN equals NaN (any payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return False
    a2, b2 = a[~an], b[~bn]
    itype = {torch.float32: torch.int32, torch.float64: torch.int64,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a2.contiguous().view(itype), b2.contiguous().view(itype))


def float_bits_equal(x, y):
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return struct.pack("<d", float(x)) == struct.pack("<d", float(y))


def compare(ref, got):
    lm = len(ref["losses"]) == len(got["losses"]) and all(
        bits_equal(a, b) for a, b in zip(ref["losses"], got["losses"]))
    sm = len(ref["scales"]) == len(got["scales"]) and all(
        float_bits_equal(a, b) for a, b in zip(ref["scales"], got["scales"]))
    wm = ref["weights"].keys() == got["weights"].keys() and all(
        bits_equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    first_diff = None
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        if not bits_equal(a, b):
            first_diff = (i, a.item(), b.item())
            break
    return lm, sm, wm, first_diff


def fmt_event(e):
    return (f"  {e.code} [{e.severity}] step={e.step} module={e.module!r} op={e.op!r} "
            f"line={e.source}\n      message: {e.message}")


def main(mod):
    torch.set_num_threads(1)
    if "--plain" in sys.argv:
        print("== PLAIN (torch only, diagnostics) ==")
        ctx = mod.setup()
        res = mod.loop(ctx, diag=True)
        print("losses:", [round(l.item(), 4) for l in res["losses"]])
        if res["scales"]:
            print("scales:", res["scales"])
        return

    import amp_runtime

    ctx = mod.setup()
    ref = mod.loop(ctx, diag=False)
    print("== REFERENCE (unguarded) ==")
    print("losses:", [round(l.item(), 4) for l in ref["losses"]])
    if ref["scales"]:
        print("scales:", ref["scales"])

    all_codes = set()
    all_lm = all_sm = all_wm = True
    for label, kwargs in mod.GUARD_RUNS:
        ctx = mod.setup()
        kw = dict(kwargs)
        if kw.pop("pass_model", True) and ctx.get("model") is not None:
            kw["model"] = ctx["model"]
        kw["policy"] = "record"
        shown = {k: (type(v).__name__ if k == "model" else v) for k, v in kw.items()}
        print(f"\n== GUARDED run '{label}': guard({shown}) ==")
        with amp_runtime.guard(**kw) as g:
            got = mod.loop(ctx, diag=False)
        lm, sm, wm, diff = compare(ref, got)
        all_lm &= lm
        all_sm &= sm
        all_wm &= wm
        print(f"  [{label}] losses bit-identical: {lm}; scales: {sm}; weights: {wm}"
              + (f"; first loss diff at step {diff}" if diff else ""))
        events = list(g.report.events)
        print(f"  [{label}] {len(events)} events kept, len(report)={len(g.report)}")
        for e in events:
            print(fmt_event(e))
        try:
            js = g.report.to_json()
            counts = js.get("counts", {})
            print(f"  [{label}] counts: {json.dumps(counts, sort_keys=True)}")
            all_codes |= set(counts)
        except Exception as exc:  # pragma: no cover - report only
            print("  to_json failed:", repr(exc))
        try:
            print(g.report.summary())
        except Exception as exc:  # pragma: no cover
            print("  summary failed:", repr(exc))
        all_codes |= {e.code for e in events}
    print()
    print(f"LOSSES_MATCH {all_lm}")
    print(f"SCALES_MATCH {all_sm}")
    print(f"WEIGHTS_MATCH {all_wm}")
    print("EVENTS " + json.dumps(sorted(all_codes)))

# -- the scenario ---------------------------------------------------------------------

CLASSES, STEPS, BATCH = 10, 60, 32


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, CLASSES))

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))


class Data:
    """Synthetic 16x16 'digits': each class is a fixed random template plus noise and a shift."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(CLASSES, 1, 16, 16, generator=g)
        self.g = torch.Generator().manual_seed(seed + 1)

    def batch(self):
        y = torch.randint(0, CLASSES, (BATCH,), generator=self.g)
        shift = int(torch.randint(-2, 3, (1,), generator=self.g))
        x = torch.roll(self.templates[y], shifts=shift, dims=3) + 0.8 * torch.randn(BATCH, 1, 16, 16, generator=self.g)
        return x, y


def setup():
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS, pct_start=0.3)
    scaler = torch.amp.GradScaler("cpu")
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    return {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "criterion": criterion, "data": Data(3)}


def loop(ctx, diag=False):
    model, opt, sched, scaler, criterion, data = (ctx[k] for k in ("model", "opt", "sched", "scaler", "criterion", "data"))
    losses, scales = [], []
    model.train()
    for step in range(STEPS):
        x, y = data.batch()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = criterion(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if diag:
            pre_max = max(p.grad.abs().max().item() for p in model.parameters())
            pre_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
            n_clipped = sum(int((p.grad.abs() > 0.1).sum()) for p in model.parameters())
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.1)
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
        if diag:
            acc = (logits.argmax(1) == y).float().mean().item()
            print(f"step {step:2d} loss {loss.item():.4f} acc {acc:.2f} lr {sched.get_last_lr()[0]:.4f} "
                  f"scale {scales[-1]:.0f} unscaled grad: max|g| {pre_max:.3g} norm {pre_norm:.3g} values clipped {n_clipped}")
    return {"losses": losses, "scales": scales,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


GUARD_RUNS = [("auto", {})]

if __name__ == "__main__":
    main(sys.modules[__name__])
