"""EXPECT: none

FAULT: none (healthy control). A bf16 house-price regressor (no GradScaler, as bf16
allows) predicts prices in thousands of dollars (targets ~300-900), so the MSE gradients
are huge: the raw total gradient norm is ~1.4e3 to 1.2e5 for the whole run, far above AMP104's
limits of 100 / 1000. The loop clips with `clip_grad_norm_(..., 1.0)` before
`optimizer.step()`, so the gradients the optimizer applies always have norm 1, and
AMP104 judges the applied (clipped) norm: nothing to report. Everything else is finite
and the loss falls (from ~3.5e5 to ~550), the MLP has no residual adds and the loss is
computed on upcast predictions, so there is no low-precision add or reduction; the
schedule is OneCycleLR.
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_FEATURES, HIDDEN, BATCH, STEPS = 16, 128, 64, 150


class PriceRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.SiLU(),
            nn.Linear(HIDDEN, HIDDEN), nn.SiLU(),
        )
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, features):
        return self.out(self.body(features)).float().squeeze(-1)


def listings(generator):
    weights = torch.rand(N_FEATURES, generator=generator) * 60.0
    while True:
        features = torch.randn(BATCH, N_FEATURES, generator=generator)
        price = 600.0 + features @ weights + 10.0 * torch.randn(BATCH, generator=generator)
        yield features, price


model = PriceRegressor()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-2, total_steps=STEPS, pct_start=0.15)
data = listings(torch.Generator().manual_seed(17))

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        features, price = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(features)
            loss = F.mse_loss(pred, price)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        raw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        if step % 10 == 0 or step == STEPS - 1:
            applied = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
            print(f"step {step:3d} loss {loss.item():.1f} raw_grad_norm {raw_norm.item():.3e} "
                  f"applied_norm {applied:.3f} lr {scheduler.get_last_lr()[0]:.2e}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
