"""EXPECT: AMP003

FAULT: a multi-label image tagger in the classic style: the model ends in `nn.Sigmoid()`
and the criterion is `nn.BCELoss()` built in `__init__` of the training wrapper, called
as `self.criterion(probs, targets)` inside the fp16 CPU autocast region (with a
GradScaler). CPU autocast has binary_cross_entropy on its float32 list and runs it, so
the run trains without an error and with finite losses (the logits stay within +-6, so
no probability rounds to exactly 0/1 in fp16 and nothing overflows), but the same code
raises on CUDA and the docs say the call is reported with autocast on, on any device:
AMP003 at step 0 (first watched step), at the line
`loss = self.criterion(probs, targets)` in `Trainer.train_step` (op
binary_cross_entropy). No numeric code is expected: no skipped steps, unscaled gradient norm ~0.1-0.2.
25 optimizer steps.
"""
import json
import os
import sys

import torch
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
N_TAGS = 12


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, N_TAGS), nn.Sigmoid())

    def forward(self, x):
        return self.classifier(self.features(x))


class Trainer:
    def __init__(self, model, lr=2e-3):
        self.model = model
        self.criterion = nn.BCELoss()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.scaler = torch.amp.GradScaler("cpu")

    def train_step(self, images, targets):
        self.model.train()
        with torch.autocast("cpu", dtype=torch.float16):
            probs = self.model(images)
            loss = self.criterion(probs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach(), norm, probs.detach()


def make_batch(g, n=32):
    targets = (torch.rand(n, N_TAGS, generator=g) < 0.25).float()
    images = torch.randn(n, 3, 24, 24, generator=g) * 0.5
    # each present tag brightens one 4x4 patch of one channel
    for t in range(N_TAGS):
        r, c, ch = (t // 4) * 8, (t % 4) * 6, t % 3
        images[:, ch, r:r + 4, c:c + 4] += 1.5 * targets[:, t].view(-1, 1, 1)
    return images, targets


def main():
    g = torch.Generator().manual_seed(1)
    trainer = Trainer(Tagger())
    for step in range(25):
        images, targets = make_batch(g)
        loss, norm, probs = trainer.train_step(images, targets)
        if DEBUG:
            p = probs.float()
            print(f"step {step} loss {loss.item():.4f} norm {norm.item():.3f} scale {trainer.scaler.get_scale()} "
                  f"p_range [{p.min().item():.4f}, {p.max().item():.4f}]", file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    main()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
