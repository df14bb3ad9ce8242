"""EXPECT: none
MAY: none
FAULT: none injected (healthy control). A small regressor on a stellar catalogue whose
features are raw SI values (mass in kg ~1e29..2e31, radius in m, luminosity in W, effective
temperature in K) trains under bf16 autocast (no GradScaler: "bf16 autocast with no
scaler (correct)") with Adam for 30 steps. Its first Linear (no bias) sees the raw masses, so its bf16
output holds values of ~1e30..1e31 (checked in plain torch: per-step peaks 1.6e31..2.5e31,
finite; bf16 reaches 3.4e38), compressed right after by a symlog, `sign(h) * log1p(|h|)`, then
/16 -> Linear -> GELU -> Linear; the loss is MSE on `.float()` outputs. The
symlog's derivative ~1e-30 is a normal bf16 number (min normal 1.2e-38), and the first
layer's weight gradients are O(1) (x ~1e30 times ~1e-30). The plain run checks: losses
finite and falling (1.57 -> 0.87), unscaled grad norm < 100 (max 44.5) and every layer's max |grad| > 1e-10 at every
step. The guard must stay silent: AMP102 is fp16-only ("an fp16 output with |x| > 60000");
AMP101 needs NaN/Inf, and nothing is non-finite; AMP104/AMP105 are ruled out by the
numbers above; there is no low-precision add (AMP110) or reduction (AMP004/AMP111) in the
model; AMP010 does not apply to bf16 without a scaler. Run twice under the guard: default
`trace="auto"`, and `trace="always"` (every op's output peak is measured, which must not
misread 1e30 as an overflow). EVENTS is the union of both runs.
"""
import json
import sys

import torch
from torch import nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(0)

import amp_runtime  # noqa: E402

STEPS = 30
M_SUN, R_SUN, L_SUN = 1.989e30, 6.957e8, 3.828e26


class StellarNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 32, bias=False)  # sees raw SI values
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x):
        h = self.embed(x)  # bf16, |h| ~ 1e30
        h = torch.sign(h) * torch.log1p(h.abs())  # symlog compression
        return self.mlp(h / 16.0)


def batch(step):
    g = torch.Generator().manual_seed(70 + step)
    m = 10 ** (torch.rand(64, generator=g) * 2.3 - 1.0)  # 0.1 .. 20 solar masses
    mass = m * M_SUN
    radius = m ** 0.8 * R_SUN
    lum = m ** 3.5 * L_SUN
    teff = 5772.0 * m ** 0.5
    x = torch.stack([mass, radius, lum, teff], dim=1)
    y = (torch.log10(m) * 2.0).unsqueeze(1)  # predict log mass (scaled)
    return x, y


def train(probe=None):
    torch.manual_seed(0)
    model = StellarNet()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(x)
            loss = F.mse_loss(pred.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if probe is not None:
            probe(step, model, x, loss)
        opt.step()
        losses.append(loss.detach().clone())
    return model, losses


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def main():
    facts = []

    def probe(step, model, x, loss):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.embed(x)
        facts.append(dict(step=step, h_dtype=str(h.dtype), h_peak=float(h.float().abs().max()),
                          loss=float(loss.detach()),
                          gnorm=float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()),
                          layer_min=min(float(p.grad.abs().max()) for p in model.parameters())))

    model0, l0 = train(probe)
    for f in facts[:3] + facts[-2:]:
        print("plain step %(step)2d embed out %(h_dtype)s peak %(h_peak).3g loss %(loss).4f grad norm %(gnorm).3g "
              "min per-layer max |grad| %(layer_min).3g" % f)
    print("plain: peak range %.3g..%.3g, max grad norm %.3g, min per-layer max %.3g, loss %.3f -> %.3f" % (
        min(f["h_peak"] for f in facts), max(f["h_peak"] for f in facts), max(f["gnorm"] for f in facts),
        min(f["layer_min"] for f in facts), facts[0]["loss"], facts[-1]["loss"]))
    assert all(1e29 < f["h_peak"] < 1e32 and f["h_dtype"] == "torch.bfloat16" for f in facts)
    assert all(torch.isfinite(v) for v in l0)
    assert sum(float(v) for v in l0[-5:]) < 0.75 * sum(float(v) for v in l0[:5])
    assert max(f["gnorm"] for f in facts) < 100 and min(f["layer_min"] for f in facts) > 1e-10
    if "--plain-only" in sys.argv:
        return

    codes = set()
    all_lm = all_wm = True
    for trace in ("auto", "always"):
        with amp_runtime.guard(policy="record", trace=trace) as g:
            model1, l1 = train()
        lm = len(l0) == len(l1) and all(same(a, b) for a, b in zip(l0, l1))
        sd0, sd1 = model0.state_dict(), model1.state_dict()
        wm = all(same(sd0[k], sd1[k]) for k in sd0)
        print(f"--- guard(policy='record', trace='{trace}'): LOSSES_MATCH {lm} WEIGHTS_MATCH {wm}")
        for ev in g.report.events:
            codes.add(ev.code)
            print("EVENT", ev.code, "step", ev.step, "module", ev.module, "op", ev.op, "source", ev.source,
                  "|", ev.message)
        print(g.report.summary())
        all_lm &= lm
        all_wm &= wm
    print(f"LOSSES_MATCH {all_lm}")
    print(f"WEIGHTS_MATCH {all_wm}")
    print("EVENTS " + json.dumps(sorted(codes)))


if __name__ == "__main__":
    main()
