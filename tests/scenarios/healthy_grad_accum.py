"""EXPECT: none

HEALTHY: fp16 autocast with a GradScaler and gradient accumulation over 4
micro-batches, the idiom of nanoGPT and most trainers: each micro-batch's loss is
divided by the number of micro-steps and backpropagated through
``scaler.scale(loss).backward()``; only at the accumulation boundary the loop calls
``scaler.unscale_(optimizer)``, ``clip_grad_norm_``, ``scaler.step(optimizer)``,
``scaler.update()`` and ``optimizer.zero_grad(set_to_none=True)``. The next batch
is fetched between forward and backward, as nanoGPT does. 12 optimizer steps (48
micro-batches), inputs normalised, loss inside the autocast block, backward outside.

Pages: DESIGN "Gradient accumulation is judged once per step, not per micro-batch";
index "A training step ends at scaler.update() when a GradScaler is used". AMP006:
every scaler.step is followed by scaler.update. AMP005: unscale_ comes before the
clip. AMP010: fp16 with an active scaler. AMP002/AMP008: loss inside, backward
outside the region. No fp16 reduction (cross_entropy runs in fp32 on CPU autocast),
no fill constants, gradient norms ~1. Nothing should be reported.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

ACCUM, MICRO_BATCH, FEATURES, CLASSES = 4, 16, 32, 10

centers = torch.randn(CLASSES, FEATURES)


def get_batch():
    y = torch.randint(0, CLASSES, (MICRO_BATCH,))
    x = centers[y] + 0.8 * torch.randn(MICRO_BATCH, FEATURES)
    return x, y


model = nn.Sequential(
    nn.Linear(FEATURES, 128), nn.GELU(), nn.Dropout(0.1),
    nn.Linear(128, 128), nn.GELU(),
    nn.Linear(128, CLASSES),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    x, y = get_batch()
    for it in range(12):
        for micro in range(ACCUM):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = F.cross_entropy(logits, y) / ACCUM
            x, y = get_batch()                          # prefetch while "the GPU works"
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {it:2d} loss {loss.item() * ACCUM:.4f} grad-norm {norm.item():.3f} "
              f"scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
