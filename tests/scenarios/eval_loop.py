"""EXPECT: none

FAULT: none (healthy control). A time-series forecaster (conv encoder + BatchNorm +
Dropout + MLP head) trained with fp16 CPU autocast and a GradScaler, with an
`estimate_loss()`-style validation every 5 steps: `model.eval()`, `torch.no_grad()` +
autocast, MSE/MAE computed by the torch losses inside the region (fp32 on the CPU),
`.item()` for logging, then `model.train()` again. A ReduceLROnPlateau scheduler reads
the validation loss, the best weights are kept as an fp32 state_dict copy
(`best_val = 1e9` is a plain Python number). The validation forward runs with gradients
off and is never backpropagated; the training steps are healthy (no skipped steps,
gradient norm well below 100). 40 optimizer steps, 8 evaluations.
"""
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
CONTEXT, HORIZON, CHANNELS = 64, 8, 4


class Forecaster(nn.Module):
    def __init__(self, channels=CHANNELS, width=48):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv1d(channels, width, 5, padding=2, bias=False), nn.BatchNorm1d(width), nn.GELU(),
            nn.Conv1d(width, width, 5, padding=2, stride=2, bias=False), nn.BatchNorm1d(width), nn.GELU(),
            nn.Conv1d(width, width, 3, padding=1, stride=2, bias=False), nn.BatchNorm1d(width), nn.GELU(),
        )
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(width * CONTEXT // 4, channels * HORIZON)

    def forward(self, past):
        h = self.encoder(past).flatten(1)
        return self.head(self.drop(h)).view(-1, CHANNELS, HORIZON)


def make_series(g, n):
    t = torch.arange(CONTEXT + HORIZON).float()
    freq = 0.05 + 0.25 * torch.rand(n, CHANNELS, 1, generator=g)
    phase = 6.28 * torch.rand(n, CHANNELS, 1, generator=g)
    x = torch.sin(freq * t + phase) + 0.1 * torch.randn(n, CHANNELS, CONTEXT + HORIZON, generator=g)
    return x[..., :CONTEXT], x[..., CONTEXT:]


@torch.no_grad()
def estimate_loss(model, val_set):
    model.eval()
    out = {}
    for name, (past, future) in val_set.items():
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(past)
            mse = F.mse_loss(pred, future)
            mae = F.l1_loss(pred, future)
        out[name] = (mse.item(), mae.item())
    model.train()
    return out


def train():
    g = torch.Generator().manual_seed(1)
    model = Forecaster()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2)
    scaler = torch.amp.GradScaler("cpu")
    val_set = {"val": make_series(g, 128), "val_long": make_series(g, 64)}
    best_val, best_state = 1e9, None
    model.train()
    for step in range(40):
        past, future = make_series(g, 32)
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(past)
            loss = F.mse_loss(pred, future)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 5 == 4:
            losses = estimate_loss(model, val_set)
            val_mse = losses["val"][0]
            scheduler.step(val_mse)
            if val_mse < best_val:
                best_val = val_mse
                best_state = copy.deepcopy(model.state_dict())
            if DEBUG:
                print(f"step {step} train {loss.item():.4f} val {losses} lr {optimizer.param_groups[0]['lr']:.1e} "
                      f"scale {scaler.get_scale()}", file=sys.stderr)
    model.load_state_dict(best_state)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
