"""EXPECT: AMP107,AMP108
MAY: AMP103,AMP104

FAULT: a sensor classifier has a learned "humidity floor" that only the rare
samples carrying a humidity reading use (about 2% of them). The floor is a scalar
parameter initialised to 0.0 and kept non-negative through ``.sqrt()``
(root module ``SensorNet.forward``, line 49: ``floor = self.humidity_floor.sqrt()``). The forward
value sqrt(0) = 0 is finite, but its derivative 0.5 / sqrt(0) is inf, so the gradient
of ``humidity_floor`` is inf (or 0 * inf = NaN in a batch without a humidity sample)
in every step, whatever the loss scale. GradScaler skips every step (the parameter
never moves away from 0) and halves the scale each time: 32768 after step 0, 1.0
after step 15, 2^-6 after step 21 (checked in plain torch).

Pages: AMP108 "5 consecutive decreases, a scale below 1/100 of its initial value, or a
scale below 128 that is still falling" (all three hold from step 4 / 6 / 9 on);
AMP107 "Reads the GradScaler's scale after every scaler.update() and reports when it
is at or below 1 and not rising" (from step 15). AMP112 does not apply (the loss is
finite), nor AMP101 (every forward output is finite). AMP109 needs a full 100-step
window counted from the first step the scaler did not skip: there is none.
MAY: AMP103's page says "Steps that a GradScaler skips because of inf/NaN gradients
are not AMP103", but the README says the replay of a failing step makes "AMP101 (or,
for a backward-only fault, AMP103)" name the op, also when "a GradScaler skipped the
step": left open. AMP104 measures the total unscaled grad norm every step; with an
inf gradient that norm is inf (> 1000), and the page does not say whether skipped
steps count.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


class SensorNet(nn.Module):
    def __init__(self, n_features=32, n_classes=5):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(n_features, 64), nn.GELU(), nn.Linear(64, 64))
        self.head = nn.Linear(64, n_classes)
        # additive floor for the humidity channel, learned, must stay >= 0
        self.humidity_floor = nn.Parameter(torch.zeros(()))

    def forward(self, x, humidity_present):
        h = self.encoder(x)
        floor = self.humidity_floor.sqrt()
        h = h + floor * humidity_present[:, None]
        return self.head(h)


def make_batch(batch_size=64):
    x = torch.randn(batch_size, 32)
    present = (torch.rand(batch_size) < 0.02).float()
    y = torch.randint(0, 5, (batch_size,))
    return x, present, y


model = SensorNet()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(22):
        x, present, y = make_batch()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x, present)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:2d} loss {loss.item():.4f} scale {scaler.get_scale():g} "
              f"floor-grad {model.humidity_floor.grad.item()}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
