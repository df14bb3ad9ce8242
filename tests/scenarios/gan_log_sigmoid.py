"""EXPECT: AMP108, AMP107, AMP112
MAY: AMP101, AMP104, AMP105, AMP106
FAULT: the discriminator loss (line 95) is written by hand as
-(log(sigmoid(d_real)) + log(sigmoid(-d_fake))) on fp16 logits inside CPU fp16 autocast (sigmoid
and log stay fp16). One GradScaler serves both networks (scaler.step(opt_d), scaler.step(opt_g),
one scaler.update() per iteration, so one guard step per iteration). Measured in --plain:
D grows confident (d_real up to ~9.7 by step 16) while G chases D's "real" region, so d_fake
reaches 11.8 at step 16: sigmoid(-d_fake) = 7.6e-6 and the fp16 backward of log (1/sigmoid x the
loss scale) overflows -> D's scaled grads inf, scaler skips opt_d and halves the scale on 17
consecutive steps (16-32: 32768 -> 0.25, scale 1.0 at step 30). D is frozen while G keeps
moving, d_fake reaches 20.8 at step 28, sigmoid(-d_fake) underflows to exactly 0 in fp16 and
log(0) = -inf: d_loss = +inf at steps 28, 29, 30 and 32 (forward only in the loss line; D's and
G's module outputs stay finite). From step 33 D's grads are finite again, but the scale stays at
0.25 for the rest of the run (growth_interval 2000), far too low for fp16 gradients.
(One earlier skip at step 11, D grads finite there: the G backward overflowed at 65536.)
Codes, per the pages:
  AMP108 - 5 consecutive decreases after steps went through (steps 16-20), then < init/100
           (step 22, 256) and < 128 falling (step 24); line 108 scaler.update().
  AMP107 - scale 1.0 at step 30, 0.5, then 0.25 and not rising through step 59.
  AMP112 - d_loss = +inf at backward (line 96), step 28 (and 29, 30, 32).
           The replay re-runs G and D (root modules) whose outputs are finite; the log is in
           functional code outside any module, so the page says the message points at the loss.
  MAY AMP101 - only live per-op tracing (if switched on after the first anomaly) can see
           torch.log at line 95 turning 0 into -inf (steps 29/30/32), with no module.
  MAY AMP104/AMP105/AMP106 - with the scale stuck at 0.25 the fp16 gradients underflow, and
           when D resumes (steps 33-35) the losses jump (g_loss 10.3): norms may be extreme.
  Not AMP103 (scaler skips D's steps; G's own grads are finite), not AMP109 (window).
"""
import math
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

ZDIM, STEPS, BATCH = 8, 60, 64


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(ZDIM, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                                 nn.Linear(128, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def real_batch(gen):
    # 8 Gaussians on a ring of radius 4
    k = torch.randint(0, 8, (BATCH,), generator=gen)
    ang = k.float() * (2 * math.pi / 8)
    centers = torch.stack([4 * torch.cos(ang), 4 * torch.sin(ang)], dim=1)
    return centers + 0.1 * torch.randn(BATCH, 2, generator=gen)


def setup():
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=LR_G, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=LR_D, betas=(0.5, 0.999))
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(7)
    return {"G": G, "D": D, "opt_g": opt_g, "opt_d": opt_d, "scaler": scaler, "gen": gen}


LR_G, LR_D = 2e-3, 5e-3


def loop(ctx, diag=False):
    G, D, opt_g, opt_d, scaler, gen = (ctx[k] for k in ("G", "D", "opt_g", "opt_d", "scaler", "gen"))
    losses, scales = [], []
    for step in range(STEPS):
        real = real_batch(gen)
        z = torch.randn(BATCH, ZDIM, generator=gen)

        # --- discriminator step ---
        opt_d.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            d_real = D(real)
            d_fake = D(fake.detach())
            # hand-written -log D(x) - log(1 - D(G(z))) in fp16
            d_loss = -(torch.log(torch.sigmoid(d_real)) + torch.log(torch.sigmoid(-d_fake))).float().mean()
        scaler.scale(d_loss).backward()
        if diag:
            d_grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in D.parameters() if p.grad is not None)
        scaler.step(opt_d)

        # --- generator step (non-saturating loss, written stably) ---
        opt_g.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            d_gen = D(fake)
            g_loss = F.softplus(-d_gen.float()).mean()
        scaler.scale(g_loss).backward()
        scaler.step(opt_g)
        scaler.update()

        losses.append(d_loss.detach().clone())
        losses.append(g_loss.detach().clone())
        scales.append(scaler.get_scale())
        if diag:
            with torch.no_grad():
                print(f"step {step:2d} d_loss {d_loss.item():.4f} g_loss {g_loss.item():.4f} scale {scales[-1]:.0f} "
                      f"d_real[min,max]=[{d_real.float().min().item():.2f},{d_real.float().max().item():.2f}] "
                      f"d_fake[min,max]=[{d_fake.float().min().item():.2f},{d_fake.float().max().item():.2f}] "
                      f"sigmoid(d_real)==0: {int((torch.sigmoid(d_real) == 0).sum())} "
                      f"sigmoid(-d_fake)==0: {int((torch.sigmoid(-d_fake) == 0).sum())} "
                      f"D grads finite(scaled): {d_grads_finite} "
                      f"min sigmoid(d_real)={torch.sigmoid(d_real).min().item():.3g} "
                      f"min sigmoid(-d_fake)={torch.sigmoid(-d_fake).min().item():.3g} "
                      f"fake radius {fake.float().norm(dim=1).mean().item():.2f}")
    weights = {f"G.{k}": v.detach().clone() for k, v in G.state_dict().items()}
    weights.update({f"D.{k}": v.detach().clone() for k, v in D.state_dict().items()})
    return {"losses": losses, "scales": scales, "weights": weights}


GUARD_RUNS = [("auto", {})]

if __name__ == "__main__":
    main(sys.modules[__name__])
