"""EXPECT: AMP005
FAULT: small CNN image classifier, fp16 autocast + GradScaler("cpu"), SGD(momentum) + StepLR,
gradient clipping. From step 0 on, `torch.nn.utils.clip_grad_norm_` runs right after
`scaler.scale(loss).backward()` with no `scaler.unscale_(optimizer)` before it (line marked
"# <- clip on scaled grads"), so it clips gradients still multiplied by the loss scale (65536):
AMP005 at that line, step 0 (and every watched step; every step does it). No overflow, no NaN:
the run only crawls because the real gradients are shrunk ~65536x by the clip.
MAY: none expected besides AMP005 (grads after the clip have unscaled norm ~1.5e-5, above
AMP105's 1e-6)
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


class SmallCNN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1),
        )
        self.classifier = nn.Linear(32, n_classes)

    def forward(self, images):
        return self.classifier(self.features(images).flatten(1))


def make_data(n=1024):
    g = torch.Generator().manual_seed(11)
    labels = torch.randint(0, 10, (n,), generator=g)
    protos = torch.randn(10, 3, 16, 16, generator=g)
    images = protos[labels] * 0.5 + torch.randn(n, 3, 16, 16, generator=g)
    return images, labels


images, labels = make_data()
model = SmallCNN()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(50):
        idx = torch.arange(step * 32, (step + 1) * 32) % images.size(0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images[idx]), labels[idx])
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)   # <- clip on scaled grads
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
