"""EXPECT: AMP103, AMP112
MAY: none
FAULT: a NaN made only in the backward, at step 17, by torch.norm of an all-zero vector.
The model returns (flow, loss); its submodule `criterion` (RobustFlowLoss, a robust L_q
end-point-error loss, q=0.4) computes diff = (pred - gt) * valid, epe = torch.norm(diff, dim=1)
(line 49) and robust = epe.pow(0.4) (line 50). Only the batch of step 17 (SPARSE_AT)
has pixels without ground truth (valid = 0 on the right half of sample 3: 128 pixels), whose
diff is an all-zero 2-vector: the norm is 0, 0 ** 0.4 = 0, the forward and the loss are finite
(0.9398). In the backward, pow's derivative at 0 is 0.4 * 0 ** -0.6 = inf (finite incoming grad,
inf out) and norm's backward turns it into NaN (0 * inf); NaN then reaches every parameter.
NOTE, measured in --plain with torch 2.13: the gradient of torch.norm alone at an all-zero
vector is 0, not NaN (PyTorch defines the subgradient), so "the gradient of the norm at 0" only
gives NaN combined with an op whose derivative at 0 is infinite (here the robust power; sqrt
would do the same). The first backward op to turn finite into non-finite is pow (op pow,
module criterion, line 50); norm (line 49) is where NaN first appears. bf16 CPU
autocast, no GradScaler (bf16 needs none), clip_grad_norm_(1.0) (returns NaN), AdamW: the step
writes NaN into all 6 parameters; from step 18 every loss is NaN (steps 18-39).
Codes, per the pages:
  AMP103 - step 17: NaN gradients reach opt.step() (line 109); the replay re-runs the model,
           whose own returned loss lets the replayed backward reproduce the NaN in all 6
           parameters, so the page promises "first non-finite in the backward of pow in
           criterion" with the line of the pow (norm would be a near miss).
  AMP112 - steps 18-39: NaN loss at backward (line 105); the replay should say the forward
           started from a parameter already NaN (e.g. encoder.0.weight) rather than an op.
  Not AMP101 (no op turns finite inputs into NaN in any forward), not AMP108/107 (no scaler).
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

H_, W_ = 16, 16
STEPS, BATCH = 40, 8
SPARSE_AT = 17          # the only batch with sparse ground truth (a KITTI-like sample)


class RobustFlowLoss(nn.Module):
    """Robust L_q end-point-error loss (q < 1 down-weights outliers), averaged over valid pixels."""

    def __init__(self, q=0.4):
        super().__init__()
        self.q = q

    def forward(self, pred, gt, valid):
        diff = (pred - gt) * valid[:, None]              # invalid pixels contribute a zero vector
        epe = torch.norm(diff, p=2, dim=1)               # per-pixel end-point error
        robust = epe.pow(self.q)
        return (robust * valid).sum() / valid.sum().clamp(min=1.0)


class TinyFlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(2, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.GELU(),
        )
        self.flow_head = nn.Conv2d(32, 2, 3, padding=1)
        self.criterion = RobustFlowLoss(q=0.4)

    def forward(self, frames, gt=None, valid=None):
        flow = self.flow_head(self.encoder(frames))
        if gt is None:
            return flow
        return flow, self.criterion(flow, gt, valid)


class FlowData:
    """Two frames of a smooth random pattern shifted by a per-sample constant flow."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, step):
        base = F.avg_pool2d(torch.randn(BATCH, 1, H_ + 4, W_ + 4, generator=self.g), 5, stride=1)
        flow = torch.randn(BATCH, 2, 1, 1, generator=self.g).expand(BATCH, 2, H_, W_)
        dx = flow[:, 0:1] * 0.5
        frame2 = base + dx * torch.roll(base, 1, dims=3)             # a crude warp
        frames = torch.cat([base, frame2], dim=1)
        valid = torch.ones(BATCH, H_, W_)
        if step == SPARSE_AT:
            valid[3, :, W_ // 2:] = 0.0                               # no ground truth on the right half
        return frames, flow.contiguous(), valid


def setup():
    torch.manual_seed(0)
    model = TinyFlowNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    return {"model": model, "opt": opt, "data": FlowData(8)}


def loop(ctx, diag=False):
    model, opt, data = ctx["model"], ctx["opt"], ctx["data"]
    losses = []
    for step in range(STEPS):
        frames, gt, valid = data.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            flow, loss = model(frames, gt, valid)
        if diag:
            zero_vecs = int((torch.norm((flow.detach().float() - gt) * valid[:, None], dim=1) == 0).sum())
        loss.backward()
        if diag:
            bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        if diag:
            wbad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
            print(f"step {step:2d} loss {loss.item():.4f} (finite {bool(torch.isfinite(loss))}) zero diff vectors {zero_vecs} "
                  f"grad norm {gn.item():.3g} non-finite grads in {bad if len(bad) < 3 else f'{len(bad)} params'} "
                  f"non-finite weights after step: {len(wbad)}")
    return {"losses": losses, "scales": [],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def demo_norm_gradient_at_zero():
    """Plain torch: what the gradient of torch.norm at an all-zero vector is in this torch."""
    print(f"torch {torch.__version__}")
    x = torch.zeros(3, requires_grad=True)
    torch.norm(x).backward()
    print("  grad of torch.norm(x) at x = 0:", x.grad.tolist(), "(PyTorch defines the subgradient 0)")
    x = torch.zeros(3, requires_grad=True)
    n = torch.norm(x)
    n.retain_grad()
    n.pow(0.4).backward()
    print("  grad of torch.norm(x).pow(0.4) at x = 0:", x.grad.tolist(), "; d/dnorm =", n.grad.item(),
          "(pow's backward: 0.4 * 0^-0.6 = inf; norm's backward then makes NaN)")


GUARD_RUNS = [("auto", {})]

if __name__ == "__main__":
    if "--plain" in sys.argv:
        demo_norm_gradient_at_zero()
    main(sys.modules[__name__])
