"""EXPECT: AMP101,AMP107,AMP108,AMP112
FAULT: tabular house-price regressor (MLP), fp16 autocast + GradScaler("cpu"), Adam, every batch
from step 0 on. The feature matrix is fed unstandardised: the column `lot_area` (square feet,
70_000-250_000) is beyond fp16's 65504, so the first Linear of the MLP, module `mlp.0`
(F.linear called from the line marked "# <- overflow" in PriceMLP.forward), outputs inf/NaN on
every step. Every loss is non-finite at `scaler.scale(loss).backward()` (AMP112, steps 0-39),
GradScaler skips every step and halves its scale each time: 5 consecutive decreases by step 4
(AMP108), scale 1.0 after the update of step 15 (65536 / 2**16), 0.5 after step 16 and still
falling (AMP107, from step 15). The replay of the
first skipped step (trace="auto") names F.linear in `mlp.0` at step 0 (AMP101).
MAY: AMP109 (every step is skipped; "more than 1% of recent steps and rising"), AMP104 if NaN/inf
gradient norms of skipped steps are judged (docs do not say so)
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N = 2048


def make_dataset():
    g = torch.Generator().manual_seed(3)
    rooms = torch.randint(2, 9, (N,), generator=g).float()
    age = torch.rand(N, generator=g) * 80
    lot_area = 70_000 + torch.rand(N, generator=g) * 180_000          # square feet
    dist_km = torch.rand(N, generator=g) * 30
    x = torch.stack([rooms, age, lot_area, dist_km, rooms * 12.5, torch.rand(N, generator=g)], dim=1)
    price = 50 + 25 * rooms - 0.8 * age + 4e-4 * lot_area - 2.5 * dist_km
    y = (price + torch.randn(N, generator=g) * 10) / 100                  # target in 100k units
    return x, y


class PriceMLP(nn.Module):
    def __init__(self, n_features):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(n_features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 1))

    def forward(self, features):
        return self.mlp(features).squeeze(-1)                              # <- overflow


x_all, y_all = make_dataset()
# the fault: the StandardScaler step of the pipeline was dropped; raw features go to the model
model = PriceMLP(x_all.size(1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(40):
        idx = torch.arange(step * 64, (step + 1) * 64) % N
        xb, yb = x_all[idx], y_all[idx]
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(xb)
            loss = F.mse_loss(pred.float(), yb)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
