"""EXPECT: none
FAULT: none (healthy control). A bf16 tabular regressor trained on raw, unstandardised
prices (thousands of dollars, RMSE ~380 at the start) with gradient accumulation over
4 micro-batches (loss divided by ACCUM_STEPS, the next micro-batch fetched between
forward and backward), then `clip_grad_norm_(model.parameters(), 1.0)` once per
optimizer step. A GradScaler exists but is disabled (`enabled=False`, kept for an
fp16 configuration) and all its methods are called unconditionally, as in nanoGPT.
It looks dangerous: measured without the guard, the raw total gradient norm that
`clip_grad_norm_` returns is 943 at step 0 and between 943 and 47,600 over all 100
steps, far above both AMP104 limits. But the loop clips: the gradients the optimizer
applies have norm 1.0 at every step, and the AMP104 page judges exactly that norm
("after `clip_grad_norm_` where the loop clips ... in fp16 and bf16 alike"), once per
optimizer step, not per micro-batch. Every layer's largest applied gradient is above
2.6e-5, nothing is non-finite, no scaler is active (a disabled GradScaler is the
no-scaler idiom), so no code applies. RMSE falls from 382 to ~70.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_NUMERIC = 12
N_NEIGHBOURHOODS = 200
MICRO_BATCH = 64
ACCUM_STEPS = 4
STEPS = 100
MAX_GRAD_NORM = 1.0


class PriceModel(nn.Module):
    """Tabular regressor: numeric features + a neighbourhood embedding -> price in k$."""

    def __init__(self, hidden=256):
        super().__init__()
        self.hood = nn.Embedding(N_NEIGHBOURHOODS, 16)
        self.net = nn.Sequential(
            nn.Linear(N_NUMERIC + 16, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, numeric, hood):
        return self.net(torch.cat([numeric, self.hood(hood)], dim=-1)).squeeze(-1)


class Listings:
    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.hood_price = 150 + 400 * torch.rand(N_NEIGHBOURHOODS, generator=self.gen)
        self.coef = torch.randn(N_NUMERIC, generator=self.gen) * 30

    def get_batch(self):
        numeric = torch.randn(MICRO_BATCH, N_NUMERIC, generator=self.gen)
        hood = torch.randint(0, N_NEIGHBOURHOODS, (MICRO_BATCH,), generator=self.gen)
        price = self.hood_price[hood] + numeric @ self.coef + 20 * torch.randn(MICRO_BATCH, generator=self.gen)
        return numeric, hood, price  # prices in thousands of dollars, not standardised


listings = Listings()
model = PriceModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
# kept for the fp16 configuration; disabled under bf16, every call is a no-op
scaler = torch.amp.GradScaler("cpu", enabled=False)

with amp_runtime.guard(policy="record", model=model) as g:
    numeric, hood, price = listings.get_batch()
    for step in range(STEPS):
        for micro in range(ACCUM_STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = model(numeric, hood)
                loss = F.mse_loss(pred.float(), price) / ACCUM_STEPS
            numeric, hood, price = listings.get_batch()  # prefetch while autograd graph is alive
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        raw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == STEPS - 1:
            rmse = (loss.item() * ACCUM_STEPS) ** 0.5
            print(f"step {step:4d}  rmse {rmse:8.2f} k$  raw grad norm {raw_norm.item():10.1f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
