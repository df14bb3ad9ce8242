"""EXPECT: AMP104
MAY: none
FAULT: gradient accumulation over ACCUM=4 micro-batches where the loss is never divided by 4
(line 82: scaler.scale(loss).backward() on the undivided
mse loss), plus GradScaler("cpu", growth_interval=4) (a low growth interval), fp16 CPU autocast,
SGD, 80 optimizer steps (320 micro-batches); targets are not standardised (mean 10, spread 10).
Measured in --plain: the summed gradients are 4x too large (and SGD takes 4x steps, so the run
wanders to larger norms): unscaled total grad norm of the steps taken 23-262, median 126, 40 of
62 steps above 100 (first step taken: step 5, 119.3; it dips below 100 at steps 38 and 53-59 and
rises above again at 39 and 60). Scale: steps 0-4 all skip (65536 -> 2048, settling, before any
step went through), then the scale grows every 4 good steps and the next step overflows: skips
at 9, 14, 19, 24, 33, 41, 43, 48, 61, 66, 71, 73, 78 (13 of 75 steps after settling, ~17%),
the scale oscillating between 2048 and 16384. The fixed version (loss / 4, printed in --plain)
skips just as periodically (growth_interval 4) but its norms stay at 28-59 and its scale at
8192-32768.
What the pages say counts (guard steps end at scaler.update(): one per 4 micro-batches,
"judged once per step, not per micro-batch"):
  AMP104 - unscaled total norm > 100 (P1), reported when it first goes above (step 5), and
           again after it came back below (around steps 39 and 60); never above 1000, so P1.
           Line 88 / the step.
  Not AMP109 - the 100-step window must be full, counted from the first step the scaler did
           not skip (step 5): 75 steps is not enough, although ~17% of steps are skipped.
  Not AMP108 - the only 5 consecutive decreases are steps 0-4, before any step went through
           (settling); the scale never goes below 65536/100 = 655 nor below 128.
  Not AMP107, not AMP103 (scaler skips the overflowing steps), not AMP106 (large gradients).
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

IN, HID = 16, 64
STEPS, ACCUM, MICRO = 80, 4, 32
TARGET_SCALE = 10.0          # targets in physical units (mean 10, spread 10): not standardised


def make_model():
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, 1))


class Loader:
    """An endless loader of micro-batches from a fixed synthetic data set."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(4096, IN, generator=g)
        w = torch.randn(IN, 1, generator=g)
        self.y = TARGET_SCALE * (torch.tanh(self.x @ w / 3) + 0.1 * torch.randn(4096, 1, generator=g)) + 10.0
        self.g = torch.Generator().manual_seed(seed + 1)

    def next(self):
        idx = torch.randint(0, self.x.shape[0], (MICRO,), generator=self.g)
        return self.x[idx], self.y[idx]


def setup(divide=False):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    return {"model": model, "opt": opt, "scaler": scaler, "loader": Loader(5), "divide": divide}


GROWTH_INTERVAL = 4


def loop(ctx, diag=False):
    model, opt, scaler, loader = ctx["model"], ctx["opt"], ctx["scaler"], ctx["loader"]
    losses, scales, norms, skipped = [], [], [], []
    x, y = loader.next()
    for step in range(STEPS):
        for micro in range(ACCUM):
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
                loss = F.mse_loss(pred.float(), y)
                if ctx["divide"]:
                    loss = loss / ACCUM
            x, y = loader.next()                 # prefetch the next micro-batch before backward
            scaler.scale(loss).backward()        # FAULT: loss not divided by ACCUM
            losses.append(loss.detach().clone())
        scaler.unscale_(opt)
        if diag:
            gn = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        if diag:
            norms.append(gn.item())
            skipped.append(scales[-1] < before)
            print(f"step {step:2d} last micro loss {loss.item():9.3f} scale used {before:8.0f} -> {scales[-1]:8.0f} "
                  f"{'SKIPPED' if skipped[-1] else '       '} unscaled grad norm {gn.item():.4g}")
    if diag:
        ok = [n for n, s in zip(norms, skipped) if not s]
        print(f"divide={ctx['divide']}: skipped {sum(skipped)}/{STEPS} steps at {[i for i, s in enumerate(skipped) if s]}; "
              f"min scale {min(scales)}; grad norm of steps taken: min {min(ok):.4g} median "
              f"{sorted(ok)[len(ok) // 2]:.4g} max {max(ok):.4g}; steps with norm > 100: "
              f"{sum(n > 100 for n in ok)}, > 1000: {sum(n > 1000 for n in ok)}")
    return {"losses": losses, "scales": scales,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


GUARD_RUNS = [("auto", {})]

if __name__ == "__main__":
    main(sys.modules[__name__])
    if "--plain" in sys.argv:
        print("\n== PLAIN, the fixed version (loss / ACCUM) for comparison ==")
        loop(setup(divide=True), diag=True)
