"""EXPECT: AMP002,AMP101,AMP104,AMP108,AMP112
MAY: AMP102

FAULT: a house-price regressor keeps its targets in fp16 to save memory (prices in
thousands, ~150-2500) and computes the loss after the autocast block:
``loss = F.mse_loss(pred, targets)`` in the training loop (line 58, no module), with ``pred`` the fp16
output of the model's last Linear under CPU autocast. Outside autocast nothing
upcasts, so mse_loss runs in fp16: the squared errors (~1e6, the model starts near 0)
average far beyond 65504 and the loss is inf in every one of the 16 steps. Its
gradient does not depend on the loss value: 2 * (pred - target) / N times the scale
overflows the fp16 backward only while the scale is large, so GradScaler skips steps
0-10 (65536 -> 32) and from step 11 on the optimizer applies finite gradients whose
unscaled total norm is ~2000 (checked in plain torch), while the loss stays inf.

Pages: AMP002 runtime "a loss function that runs with autocast off on fp16/bf16
inputs that were produced under autocast" (the page's own example: "mse_loss squares
its errors, so an error of 256 squares to 65536, beyond fp16's 65504: inf").
AMP112 "the loss is NaN or Inf when backward starts" (every step). AMP101: the
replay of step 0 only re-runs root module calls ("a loss computed by functions outside
any module ... [is] not" replayed), so it cannot see mse_loss; but trace="auto" then
"switches per-op checks on for the next occurrences", and in step 1 the fp16
``mse_loss`` turns finite inputs into inf (AMP101 "the first op whose output holds
NaN or Inf while all of its inputs were finite"). AMP108 "5 consecutive decreases ...
a scale below 1/100 of its initial value, or a scale below 128 that is still falling"
(11 consecutive decreases). AMP104 "total grad norm > 100 (P1), > 1000 (P0) -
unscaled": ~2000 in steps 11-15. AMP107 not (the scale stays at 32 > 1); AMP109 not
(100-step window); AMP103 not (the skipped steps' gradients are caught by the scaler,
and the applied steps' gradients are finite).
MAY: AMP102 (whether the inf output of mse_loss counts as |x| > 60000 is not said).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N, FEATURES = 2048, 12
features = torch.randn(N, FEATURES)
true_w = torch.randn(FEATURES)
prices = (600.0 + 250.0 * (features @ true_w) / FEATURES ** 0.5).clamp(150.0, 2500.0)
targets_all = prices.to(torch.float16)                    # stored compactly in fp16

model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(16):
        idx = torch.randint(0, N, (128,))
        x, targets = features[idx], targets_all[idx]
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x).squeeze(-1)
        loss = F.mse_loss(pred, targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:2d} loss {loss.item()} ({loss.dtype}) scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
