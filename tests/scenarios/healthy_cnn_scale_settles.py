"""EXPECT: none
FAULT: none (healthy control). Small CNN that counts blobs in 16x16 images (regression, MSE on
0.8 * count / 24), fp16 autocast + GradScaler("cpu", init_scale=2**17, growth_interval=100), SGD +
momentum, 150 steps, evaluation under `torch.no_grad()` every 50 steps. Tricky-but-healthy part:
the initial scale 2**17 is above the default, and at step 0 the scaled backward overflows fp16
once; GradScaler skips step 0 and halves the scale to 2**16; after 100 good steps (at the update
of step 100) it grows back to 2**17, and no later step overflows (the gradients shrink as the
count error falls). Per the docs this is the normal calibration: "a few decreases while the
scale settles at the start of training are normal", decreases from an initial scale above 2**16
down to it "do not count as a decline" (AMP108), "a handful of skips while the scale settles are
expected" (AMP109; here 1 skip in 150 steps, 1% of a 100-step window, not more), and a skipped
step is not AMP103. The loss at each backward is finite (no AMP112) and the forward is finite
everywhere (max |fp16 activation| ~1.5), so the replay of the skipped step finds no AMP101, and
there are no low-precision adds or reductions for the per-op checks (AMP102/AMP110/AMP111) that
run for a while after it. Unscaled grad norm 0.06-1.2, no underflow (scale >= 2**16).
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


class BlobCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, images):
        return self.head(self.features(images)).squeeze(-1)


def make_data(n=4096, seed=1):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, COUNT_MAX + 1, (n,), generator=g)
    images = torch.zeros(n, 1, 16, 16)
    for i in range(n):
        k = int(counts[i])
        if k:
            pos = torch.randperm(256, generator=g)[:k]
            images[i, 0].view(-1)[pos] = 1.0
    return images, counts.float()


COUNT_MAX, TARGET_SCALE = 24, 0.8                      # target: 0.8 * count / 24
images, counts = make_data()
val_images, val_counts = make_data(256, seed=2)
model = BlobCounter()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 17, growth_interval=100)
val_history = []

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(150):
        idx = torch.arange(step * 32, (step + 1) * 32) % images.size(0)
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(images[idx])
            loss = F.mse_loss(pred.float(), counts[idx] / COUNT_MAX * TARGET_SCALE)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        if step % 50 == 49:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                val_history.append(F.l1_loss(model(val_images).float() * COUNT_MAX / TARGET_SCALE, val_counts).item())
            model.train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
