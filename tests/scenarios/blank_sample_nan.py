"""EXPECT: AMP101,AMP112

FAULT: a vibration-fault classifier standardises each window inside the model,
``x = (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)`` in
root module ``WindowClassifier.forward``, line 44 (fp32: the input is fp32 and these ops are not
autocast). One window in the batch of step 11 (line 54) comes from a disconnected sensor and is
all zeros: its std is exactly 0, 0 / 0 = NaN, and its logits and the batch loss are
NaN. GradScaler finds NaN gradients and skips that single step (one halving,
65536 -> 32768); every other step of the 30 is normal, so the run recovers.

Pages: AMP112 "the loss is NaN or Inf when backward starts" (step 11). AMP101: the
skipped step is replayed with per-op checks ("on the CPU always, before the optimizer
step"; the standardisation runs inside the model, a root module), and the first op
whose output holds NaN while its inputs were finite is the division by the std.
Not AMP103 ("Steps that a GradScaler skips because of inf/NaN gradients are not
AMP103"); not AMP108 (one decrease; the scale stays at 32768, far above init/100 and
128); not AMP109 (the 100-step window never fills in 30 steps). No fp16 reduction
(mean/std run on the fp32 input), so no AMP004.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

WINDOW, CLASSES = 256, 4


class WindowClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WINDOW, 128), nn.GELU(),
            nn.Linear(128, 64), nn.GELU(),
            nn.Linear(64, CLASSES),
        )

    def forward(self, x):
        x = (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)
        return self.net(x)


def make_batch(step, batch_size=32):
    labels = torch.randint(0, CLASSES, (batch_size,))
    t = torch.linspace(0, 1, WINDOW)
    freq = 5.0 + 10.0 * labels.float()
    x = 3.0 * torch.sin(2 * torch.pi * freq[:, None] * t) + 4.0 * torch.randn(batch_size, WINDOW) + 1.5
    if step == 11:
        x[17] = 0.0                                   # disconnected sensor
    return x, labels


model = WindowClassifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(30):
        x, labels = make_batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:2d} loss {loss.item():.4f} scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
