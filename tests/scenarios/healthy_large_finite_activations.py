"""EXPECT: none
HEALTHY: regression on raw, unnormalised process readings (8 sensors, values up to
~22000 in their physical units), fp16 autocast with a GradScaler, AdamW, trace="always".
The input projection `inp` therefore outputs activations of magnitude ~24000-31500 on
every step (checked with plain torch, no guard: the per-step peak of |inp(x)| stays
between 23552 and 31536 over 80 steps), i.e. large but finite and below the 60000
near-overflow threshold; `norm` (nn.LayerNorm, whose CPU kernel accumulates in fp32)
brings them back to O(1) right away. The scaler never skips (scale stays 65536), the
largest unscaled gradient entry is < 0.5 (loss 0.77 -> 0.43), and the loss is computed inside autocast
(`mse_loss` runs in fp32 under CPU autocast).
Why no code (from the pages): AMP102 fires only above |x| > 60000 (default
`Thresholds.near_overflow`); nothing is non-finite (AMP101/AMP103/AMP112); grad norms are
far below 100 (AMP104) and above 1e-6 (AMP105); no skip (AMP107-AMP109); the model has no
explicit low-precision add or reduction (AMP004/AMP110/AMP111); no manual cast (AMP001).
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

# full-scale ranges of the 8 sensors, in their native units
FULL_SCALE = 2.5 * torch.tensor([9000., 7000., 8000., 6000., 9000., 5000., 7000., 8000.])


class ProcessModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.norm = nn.LayerNorm(64)
        self.hid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        h = self.norm(self.inp(x))          # |inp(x)| ~ 3e4 in fp16, finite
        return self.out(F.gelu(self.hid(F.gelu(h))))


model = ProcessModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record", trace="always") as g:
    for step in range(80):
        x = torch.rand(64, 8) * FULL_SCALE
        y = (x / FULL_SCALE).sum(-1, keepdim=True) - 4.0     # target from the relative readings
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
            loss = F.mse_loss(pred, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
