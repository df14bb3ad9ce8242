"""EXPECT: AMP101,AMP112
MAY: AMP102,AMP104,AMP109

FAULT: a sensor-sequence classifier whose self-attention uses a hand-written softmax
without max subtraction (`weights = scores.exp()` in fp16 under CPU autocast, the
normaliser summed in fp32) and no LayerNorm in front of the attention, so the scores grow
with the square of the input amplitude. Training uses fp16 CPU autocast + GradScaler.
Normal batches give scores below ~3; the batch of step 12 (0-based; the 13th scaler
update) comes from a sensor recorded at 4x gain, its scores reach ~30 (> 11.1) and `exp`
overflows fp16 to inf in module `encoder.1` (a SensorAttention), at the line
`weights = scores.exp()` of `SensorAttention.forward`; inf/inf makes the attention weights NaN, the loss is NaN at
`scaler.scale(loss).backward()` (AMP112, step 12), and the GradScaler skips that step
(so it is not AMP103). The replay of step 12 must name `exp` as the first non-finite op
(AMP101, module `encoder.1`, step 12). Only that one batch is bad: the scale halves
once (65536 -> 32768) and never again, so no AMP107/AMP108. A single skipped step in 30
may or may not count as a rising overflow rate (AMP109); the skipped
step's gradient norm is inf/NaN (AMP104 left open).
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
CHANNELS, T, D, N_CLASSES, STEPS, BAD_STEP = 6, 24, 32, 4, 30, 12


class SensorAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.scale = 1.0 / math.sqrt(d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        weights = scores.exp()
        weights = weights / weights.float().sum(dim=-1, keepdim=True)
        return x + self.out(weights @ v)


class SensorClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(CHANNELS, D),
            SensorAttention(D),
            nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)),
        )
        self.head = nn.Linear(D, N_CLASSES)

    def forward(self, x):
        h = self.encoder(x)
        return self.head(h[:, -1])


def load_batch(g, step, n=32):
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    t = torch.arange(T).float().view(1, T, 1)
    freq = (0.2 + 0.15 * y.float()).view(n, 1, 1)
    # raw accelerometer-like readings in m/s^2 (not standardised)
    x = 3.5 * torch.sin(freq * t + torch.rand(n, 1, CHANNELS, generator=g) * 6.28)
    x = x + 0.5 * torch.randn(n, T, CHANNELS, generator=g)
    if step == BAD_STEP:
        x = x * 4.0            # this shard was recorded with 4x sensor gain
    return x, y


def train():
    g = torch.Generator().manual_seed(1)
    model = SensorClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(STEPS):
        x, y = load_batch(g, step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if DEBUG:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                h = model.encoder[0](x)
                q, k, _ = model.encoder[1].qkv(h).chunk(3, dim=-1)
                smax = ((q @ k.transpose(-2, -1)) * model.encoder[1].scale).max().item()
            print(f"step {step} loss {loss.item():.4f} max_score {smax:.2f} scale {scaler.get_scale()}",
                  file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
