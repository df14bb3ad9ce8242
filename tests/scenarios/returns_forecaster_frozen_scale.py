"""EXPECT: AMP106
FAULT: an fp16 return forecaster trains on raw daily log-returns (~1 % a day, not
standardised) with an MSE loss of ~1e-4 to 8e-4, and its GradScaler is pinned at a
tiny scale: `init_scale=4.0` with growth disabled (`growth_interval=10**9`). The
first layer's weight gradient is the product of tiny inputs and tiny output errors;
at scale 4 the fp16 backward flushes a large part of it. Measured without the guard,
at every step of the 100: an estimated 5-10 % of `encoder.0.weight`'s nonzero
gradients flush (about 10-20 % of its nonzero values sit in the 2^-24 bin; an fp32
reference backward of the same steps has 9-14 % of them below 2^-25 and they carry
~1.4-3.6 % of the layer's norm), far beyond AMP106's 1 % / 0.1 % limits, so AMP106
must be reported for `encoder.0`. The other layers stay below 1 %. The total unscaled
gradient norm stays between 8e-5 and 5e-2 and every layer's largest gradient above
6e-7, so it is not AMP105. The scale is 4 (above AMP107's limit of 1) and never
falls (no overflow, no skipped step), so no scaler codes. The MSE still falls
(8e-4 -> 2e-4), which is why nobody notices that the first layer trains on a
fraction of its gradient.
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

WINDOW = 64
N_ASSETS = 512
BATCH = 256
STEPS = 100
INIT_SCALE = 4.0


class ReturnForecaster(nn.Module):
    """Predicts the next daily log-return of an asset from its last WINDOW returns."""

    def __init__(self, window=WINDOW, hidden=256):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(window, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, past):
        return self.head(self.encoder(past)).squeeze(-1)


def make_market(n_assets=N_ASSETS, n_days=600, seed=0):
    """Synthetic daily log-returns (~1 % a day) with a weak AR(1) component."""
    gen = torch.Generator().manual_seed(seed)
    vol = 0.005 + 0.015 * torch.rand(n_assets, 1, generator=gen)
    shocks = torch.randn(n_assets, n_days, generator=gen) * vol
    returns = torch.zeros_like(shocks)
    returns[:, 0] = shocks[:, 0]
    for t in range(1, n_days):
        returns[:, t] = 0.2 * returns[:, t - 1] + shocks[:, t]
    return returns


def batches(returns, seed=1):
    gen = torch.Generator().manual_seed(seed)
    n_assets, n_days = returns.shape
    while True:
        asset = torch.randint(0, n_assets, (BATCH,), generator=gen)
        day = torch.randint(WINDOW, n_days, (BATCH,), generator=gen)
        idx = day.unsqueeze(1) - WINDOW + torch.arange(WINDOW).unsqueeze(0)
        past = returns[asset.unsqueeze(1), idx]
        target = returns[asset, day]
        yield past, target


returns = make_market()
model = ReturnForecaster()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
# a small, frozen loss scale: growth made the scaler skip steps on volatile days
scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=10**9)
data = batches(returns)

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        past, target = next(data)
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(past)
            loss = F.mse_loss(pred.float(), target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  mse {loss.item():.3e}  rmse {math.sqrt(loss.item()):.4f}  scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
