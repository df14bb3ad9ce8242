"""EXPECT: AMP005

FAULT: an fp16 (CPU autocast + GradScaler) residual-MLP classifier trained with gradient
accumulation (4 micro-batches, loss divided by the accumulation steps) and SGD + Nesterov
momentum calls `torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)` right
after the accumulation loop with no `scaler.unscale_(optimizer)` before it: the clip runs
on gradients the scaler has multiplied by 65536 and not unscaled (AMP005). The norm it
compares with 1.0 is the scaled one (1.4e5-1.5e5 in the log at every step), so it always
clips, and the gradients `scaler.step` then unscales and applies have a norm of
1/65536 = 1.53e-5: the model does not learn (val loss 2.355 -> 2.353, accuracy 0.11 after
60 steps; the same loop with `unscale_` first reaches val loss 0.257, accuracy 0.91). No
other code applies: the scale stays at 65536 (no overflow, no skipped step), nothing is
non-finite, the applied norm (1.53e-5) is far from 100 (AMP104) and from 1e-6 (AMP105), the
smallest per-parameter max |grad| applied is 6.7e-9 (above AMP105's 1e-10), and the fp16
gradients at scale 65536 do not underflow (the page's flush estimate is about 0.01 %).
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

NUM_FEATURES = 96
NUM_CLASSES = 10
WIDTH = 192
DEPTH = 3
MICRO_BATCH = 32
ACCUM_STEPS = 4
TOTAL_STEPS = 60
WARMUP_STEPS = 6
BASE_LR = 0.05
MAX_GRAD_NORM = 1.0
LOG_EVERY = 10


class SensorWindows:
    """Synthetic multichannel sensor windows: class-dependent prototypes plus noise."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(1234)
        self.prototypes = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=g)
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, n):
        y = torch.randint(0, NUM_CLASSES, (n,), generator=self.g)
        x = self.prototypes[y] + 3.0 * torch.randn(n, NUM_FEATURES, generator=self.g)
        return x, y


class ResidualBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(NUM_FEATURES, WIDTH)
        self.blocks = nn.Sequential(*[ResidualBlock(WIDTH) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.stem(x))))


def lr_at(step):
    if step < WARMUP_STEPS:
        return BASE_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / (TOTAL_STEPS - WARMUP_STEPS)
    return BASE_LR * 0.5 * (1 + math.cos(math.pi * progress))


model = ResMLP()
optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9, nesterov=True, weight_decay=5e-4)
scaler = torch.amp.GradScaler("cpu")
train_set, val_set = SensorWindows(seed=1), SensorWindows(seed=2)
val_x, val_y = val_set.batch(256)


def evaluate():
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        logits = model(val_x)
        loss = F.cross_entropy(logits, val_y)
    acc = (logits.argmax(-1) == val_y).float().mean().item()
    model.train()
    return loss.item(), acc


with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(TOTAL_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        running = 0.0
        for _ in range(ACCUM_STEPS):
            x, y = train_set.batch(MICRO_BATCH)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = F.cross_entropy(logits, y) / ACCUM_STEPS
            scaler.scale(loss).backward()
            running += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0 or step == TOTAL_STEPS - 1:
            val_loss, val_acc = evaluate()
            print(f"step {step:3d} | train loss {running:.4f} | val loss {val_loss:.4f} acc {val_acc:.3f} | "
                  f"grad norm {grad_norm.item():.4g} | scale {scaler.get_scale():g} | lr {lr_at(step):.2e}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
