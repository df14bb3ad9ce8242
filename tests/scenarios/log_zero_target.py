"""EXPECT: AMP101 AMP103 AMP112
MAY: AMP104 AMP105

FAULT: a bf16 demand-forecasting MLP (no GradScaler, as bf16 allows) is trained with a
log-space MSE (`LogMSELoss`: mse(log(pred), log(target))) that uses `torch.log` instead of
`torch.log1p`. The batch generator clamps sales counts to >= 1, except that the batch
of step 37 comes from a day when one store was closed and reports a count of exactly 0.
`torch.log(target)` (in the loss module, a root module the guard replays) is -inf there,
the loss is inf at backward (AMP112), the gradients are inf/NaN, and
`clip_grad_norm_` cannot repair them (clip coefficient 0 times inf is NaN): AdamW
applies NaN gradients (AMP103) and every weight becomes NaN, so every later loss is NaN
(AMP112 again). The replay of step 37 names `log` in the loss module as the first op
with a non-finite output from finite inputs (AMP101). The total norm of the applied
gradients is NaN (AMP104 may or may not treat that as an explosion).
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_FEATURES, HIDDEN, BATCH, STEPS, BAD_STEP = 24, 128, 64, 80, 37


class DemandForecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, 1),
        )

    def forward(self, features):
        return F.softplus(self.net(features).float()).squeeze(-1) + 0.1   # positive rate


class LogMSELoss(nn.Module):
    def forward(self, pred, target):
        return F.mse_loss(torch.log(pred), torch.log(target))


def sales_batches(generator):
    true_w = torch.randn(N_FEATURES, generator=generator) * 0.3
    step = 0
    while True:
        features = torch.randn(BATCH, N_FEATURES, generator=generator)
        rate = torch.exp(features @ true_w + 2.0)
        counts = torch.poisson(rate, generator=generator).clamp(min=1.0)
        if step == BAD_STEP:
            counts[11] = 0.0          # store closed that day
        step += 1
        yield features, counts


model = DemandForecaster()
criterion = LogMSELoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=STEPS, pct_start=0.2)
data = sales_batches(torch.Generator().manual_seed(3))

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        features, counts = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(features)
            loss = criterion(pred, counts)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        raw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        applied = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        optimizer.step()
        scheduler.step()
        if step % 10 == 0 or BAD_STEP - 1 <= step <= BAD_STEP + 1 or step == STEPS - 1:
            print(f"step {step:3d} loss {loss.item():.4f} raw_grad_norm {raw_norm.item():.3e} "
                  f"applied_norm {applied:.3e} lr {scheduler.get_last_lr()[0]:.2e}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
