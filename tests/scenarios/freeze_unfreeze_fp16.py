"""EXPECT: none

HEALTHY: two-stage fine-tuning under fp16 CPU autocast with a GradScaler. The AdamW optimizer is
built once over all parameters (backbone lr 3e-4, head lr 3e-3); stage 1 freezes the backbone
with `requires_grad_(False)` (line 75, before step 0), so for steps 0-15 the 14 backbone
parameters have `.grad` None and only the 4 head parameters train; at step 16 line 78 unfreezes
it and all 18 parameters train to step 47. Each step: loss inside the region, scaled backward
outside it, `unscale_` then `clip_grad_norm_` over the parameters that require grad, then
`scaler.step` and `scaler.update`; `zero_grad(set_to_none=True)`. Plain torch, no guard: no step
skipped (scale 65536 throughout), loss 1.79 -> 1.24, clipped total norm 1.0-1.4, smallest
per-parameter max |grad| 2.5e-3 among the parameters that have a gradient.

Why no event from the pages: AMP105 counts "a layer whose largest gradient magnitude is below
1e-10 (including a layer whose gradients are all exactly zero)"; a frozen layer has no gradient
at all (`.grad` is None, it is not in the step), which is neither, and freezing is not an
accident the page describes (a "detached branch" is). Unfreezing mid-run changes which
parameters have gradients, not their scale. AMP106 (checked at step 32, in stage 2) estimates
flushes at the scale 65536, with gradients of 1e-3 or more. No skipped step (AMP107-AMP109),
unscale_ before the clip (AMP005), scaler with fp16 (AMP010), backward outside autocast (AMP008),
no hand cast (AMP001), LayerNorm and the residual adds run in fp16 but are not reductions from
AMP004's list, and the adds' operands have similar magnitudes (AMP110).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

D_IN, D_MODEL, N_CLASSES = 24, 64, 5
W_TRUE = torch.randn(D_IN, N_CLASSES)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D_IN, D_MODEL), Block(D_MODEL), Block(D_MODEL))
        self.head = nn.Sequential(nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, N_CLASSES))

    def forward(self, x):
        return self.head(self.backbone(x))


def batch(gen, n=64):
    x = torch.randn(n, D_IN, generator=gen)
    y = (torch.tanh(x @ W_TRUE) + 0.3 * torch.randn(n, N_CLASSES, generator=gen)).argmax(-1)
    return x, y


model = Model()  # the backbone stands in for pretrained weights
optimizer = torch.optim.AdamW([
    {"params": model.backbone.parameters(), "lr": 3e-4},
    {"params": model.head.parameters(), "lr": 3e-3},
], weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu")
UNFREEZE_AT, STEPS = 16, 48
gen = torch.Generator().manual_seed(1)

with amp_runtime.guard(policy="record") as g:
    model.backbone.requires_grad_(False)  # stage 1: linear probe, backbone frozen
    for step in range(STEPS):
        if step == UNFREEZE_AT:
            model.backbone.requires_grad_(True)  # stage 2: fine-tune everything
            print(f"step {step}: backbone unfrozen")
        x, y = batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        if step % 8 == 0 or step == STEPS - 1:
            print(f"step {step} loss {loss.item():.4f} grad_norm {grad_norm.item():.3g} "
                  f"scale {scaler.get_scale():.4g}")

for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
