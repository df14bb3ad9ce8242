"""EXPECT: AMP101 AMP107 AMP108 AMP109 AMP112
MAY: AMP102 AMP105 AMP106

FAULT: the warm-up of an fp16 token classifier (GradScaler, `unscale_` then
`clip_grad_norm_`, AdamW) multiplies where it should divide: `warmup_then_constant`
returns `(step + 1) * WARMUP` instead of `(step + 1) / WARMUP`, so the learning rate
ramps from 0.04 to 1.6 over the first 40 steps instead of from 2.5e-5 to 1e-3. Clipping
keeps every applied gradient at norm <= 1 (no AMP104, though the raw norm passes 5000),
but AdamW moves every weight by ~lr per step regardless: the logits reach ~1.3e4 by step
15 and the head's fp16 `linear` first overflows to inf at step 17 (AMP101 from the replay of
the first non-finite step; the cross-entropy is NaN at backward: AMP112). From step ~2
on the scaled backward overflows now and then (skips, the scale falls below 128 while
falling: AMP108), and once the forward overflows every step is skipped, the weights never
change again, the scale halves every step, reaching <= 1 at step ~25 and never rising
(AMP107). The first step (0) was not skipped, so the 100-step window is full at step ~100
with nearly every step skipped and skipping continuing until step 119 (AMP109).
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, DIM, SEQ, CLASSES, BATCH = 256, 64, 20, 6, 32
STEPS, WARMUP, BASE_LR = 120, 40, 1e-3


class TokenMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.norm1 = nn.LayerNorm(DIM)
        self.ff1 = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm2 = nn.LayerNorm(DIM)
        self.ff2 = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        h = h + self.ff1(self.norm1(h)).float()
        h = h + self.ff2(self.norm2(h)).float()
        return self.head(h.mean(dim=1))


def batches(generator):
    keywords = torch.randint(0, VOCAB, (CLASSES, 3), generator=generator)
    while True:
        labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        slots = torch.randint(0, SEQ, (BATCH, 3), generator=generator)
        tokens.scatter_(1, slots, keywords[labels])
        yield tokens, labels


def warmup_then_constant(step):
    if step < WARMUP:
        return (step + 1) * WARMUP
    return 1.0


model = TokenMixer()
optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_constant)
scaler = torch.amp.GradScaler("cpu")
data = batches(torch.Generator().manual_seed(11))

skipped = 0
with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        tokens, labels = next(data)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
            loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        raw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scale = scaler.get_scale()
        lr = scheduler.get_last_lr()[0]
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if scaler.get_scale() < scale:
            skipped += 1
        if step % 5 == 0 or step == STEPS - 1:
            with torch.no_grad():
                peak = model.ff1[0].weight.abs().max().item()
            print(f"step {step:3d} lr {lr:.3g} loss {loss.item():.4f} raw_grad_norm {raw_norm.item():.3e} "
                  f"scale {scale:.3g} skipped {skipped} max|W_ff1| {peak:.1f} max|logit| {logits.detach().float().abs().max().item():.1f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
