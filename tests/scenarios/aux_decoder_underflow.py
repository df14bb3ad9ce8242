"""EXPECT: AMP106
FAULT: MLP classifier with an auxiliary reconstruction decoder (aux loss weight 1e-4), fp16
autocast + GradScaler("cpu", init_scale=8.0) (set low "to avoid skipped steps at the start";
growth_interval stays 2000, so the scale stays 8 for the whole 70-step run). From step 0 on,
at a loss scale of 8 the decoder's gradients (only the 1e-4-weighted aux loss reaches them;
max |grad| ~2e-7 at step 0) partly flush to zero in the fp16 backward: by the estimate the
docs describe (half the count of scaled values that rounded to 2**-24), ~11% of `decoder.0.weight`
and ~7% of `decoder.2.weight` at step 0, ~2-3% at step 32, ~1-2.5% at step 64. AMP106 naming
the decoder layers `decoder.0` / `decoder.2`, at step 0 (AMP106 is judged every 32nd step; also
step 32 expected), at the `scaler.step(optimizer)` line. The encoder and classifier get
normal gradients from the main loss: total unscaled norm 2e-3..1, every layer's max |grad|
>= 2e-7 (no AMP105), no overflow, no skipped step.
MAY: nothing else
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

IN, HID, Z, CLASSES = 256, 128, 32, 10
AUX_WEIGHT = 1e-4


class AuxAutoencoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, Z), nn.ReLU())
        self.classifier = nn.Linear(Z, CLASSES)
        self.decoder = nn.Sequential(nn.Linear(Z, HID), nn.ReLU(), nn.Linear(HID, IN))

    def forward(self, x):
        z = self.encoder(x)
        return self.classifier(z), self.decoder(z)


def make_data(n=4096):
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    centers = torch.rand(CLASSES, IN, generator=g)
    x = (centers[labels] + 0.3 * torch.rand(n, IN, generator=g)).clamp(0, 1)
    return x, labels


x_all, y_all = make_data()
model = AuxAutoencoderClassifier()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", init_scale=8.0)      # the fault: far too little loss scaling

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(70):
        idx = torch.arange(step * 64, (step + 1) * 64) % x_all.size(0)
        xb, yb = x_all[idx], y_all[idx]
        with torch.autocast("cpu", dtype=torch.float16):
            logits, recon = model(xb)
            loss = F.cross_entropy(logits, yb) + AUX_WEIGHT * F.mse_loss(recon.float(), xb)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
