"""EXPECT: AMP005
MAY: AMP105

FAULT: an fp16 patch classifier (GradScaler, AdamW, StepLR) clips with
`clip_grad_norm_(model.parameters(), 1.0)` right after `scaler.scale(loss).backward()`
and never calls `scaler.unscale_(optimizer)`: the clip sees the *scaled* gradients
(norm ~5e4 at scale 65536, i.e. a true norm of ~0.8), always clips them to 1, and
`scaler.step` then unscales the clipped gradients, so every applied gradient has norm
1/65536 = 1.5e-5 and the effective clip threshold follows the loss scale (AMP005 at every
clip). AdamW's per-parameter normalisation hides most of the damage (the loss still falls),
and the run stays finite with no skipped step, so no loss-scale or non-finite code. The
applied norm (1.5e-5) stays above AMP105's total limit of 1e-6 and the smallest
per-parameter max |grad| is ~4e-8 to 2e-7, far above 1e-10: AMP105 is not expected,
only listed as possible.
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

PATCHES, PATCH_DIM, DIM, CLASSES, BATCH, STEPS = 16, 48, 96, 8, 32, 60


class PatchMLPClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(PATCH_DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.mixer = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, patches):
        h = self.patch_embed(patches).float()
        h = h + self.mixer(self.norm(h)).float()
        return self.head(h.mean(dim=1))


def image_batches(generator):
    centers = torch.randn(CLASSES, PATCHES, PATCH_DIM, generator=generator)
    while True:
        labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
        patches = centers[labels] + 0.8 * torch.randn(BATCH, PATCHES, PATCH_DIM, generator=generator)
        yield patches, labels


model = PatchMLPClassifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
scaler = torch.amp.GradScaler("cpu")
data = image_batches(torch.Generator().manual_seed(7))

skipped = 0
with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        patches, labels = next(data)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(patches)
            loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        clipped_from = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scale = scaler.get_scale()
        if step % 10 == 0 or step == STEPS - 1:
            applied = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters())) / scale
            layer_max = min(float(p.grad.abs().max()) / scale for p in model.parameters())
            print(f"step {step:3d} loss {loss.item():.4f} clip_saw {clipped_from.item():.3e} "
                  f"applied_norm {applied:.3e} min_layer_max {layer_max:.3e} scale {scale:.3g} skipped {skipped}")
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if scaler.get_scale() < scale:
            skipped += 1

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
