"""EXPECT: AMP101,AMP108,AMP112
MAY: AMP102,AMP104

FAULT: a SimCLR-style contrastive run uses a temperature of 1e-3 (meant for unit-norm
embeddings) but the projection head's outputs are never L2-normalised. In
``info_nce`` (called from ``SimCLR.forward``) line 39, ``logits = (z1 @ z2.t()) / temperature`` runs in fp16 under
CPU autocast: the inputs are raw sensor windows (std 24), the similarities are
finite (up to ~220 on the diagonal, ~145 off it), but divided by 1e-3 a few hundred
of them per batch exceed 65504 and become inf (others land between 60000 and
65504); ``cross_entropy`` (fp32 on CPU autocast) of rows holding +inf is NaN.
This happens in every step: GradScaler skips all 10 steps (the weights never
change) and halves the scale 10 times, 65536 -> 64.

Pages: AMP112 "the loss is NaN or Inf when backward starts". AMP101: the first
failing step is replayed with per-op checks (``info_nce`` is called from the
``SimCLR`` module's forward, a root module; CPU), and per-op checks then stay on for
the following steps; the first op with an inf output from finite inputs is the fp16
division by the temperature (the matmul output, ~200, is finite). AMP108 "5
consecutive decreases, a scale below 1/100 of its initial value, or a scale below 128
that is still falling" (from step 4 / 6 / 9). AMP107 not: the scale ends at 64 > 1.
AMP109 needs a full 100-step window. AMP103 not: the scaler skips every step.
MAY: AMP102 (division outputs between 60000 and 65504 for some pairs, or the inf
ones; whether inf counts is not said); AMP104 (the gradients are NaN/inf; the page
does not say how a non-finite norm of a skipped step is judged).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


def info_nce(z1, z2, temperature=1e-3):
    logits = (z1 @ z2.t()) / temperature
    targets = torch.arange(z1.size(0), device=z1.device)
    return 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets))


class SimCLR(nn.Module):
    def __init__(self, in_dim=48, hidden=128, proj=128):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, proj))

    def forward(self, view1, view2):
        z1 = self.projector(self.backbone(view1))
        z2 = self.projector(self.backbone(view2))
        return info_nce(z1, z2)              # z1, z2 should be F.normalize(...)d first


def augment(x):
    return x * (1.0 + 0.1 * torch.randn_like(x)) + 0.1 * torch.randn_like(x)


model = SimCLR()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(10):
        x = 24.0 * torch.randn(64, 48)                   # unnormalised sensor windows
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(augment(x), augment(x))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:2d} loss {loss.item():.4f} scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
