"""EXPECT: none
HEALTHY: twin of f1_fp16_scaler_regrowth_overflow.py (same data, model, seed and fp16
autocast + GradScaler recipe) with growth_interval=150 instead of 10. The scaler skips
steps 0 and 1 while the scale settles from 65536 to 16384 (both before the first good
step: "the skips before the first one are the scale settling", docs/rules/AMP108.md; and
AMP109's window is counted from the first step the scaler did not skip), then grows
x2 every 150 good steps to 131072 as the gradients shrink, and never overflows again:
0 skipped steps in 598 steps after step 1, so no AMP109 (0 % < 1 %), no AMP108 (no
decrease after the first good step; scale >= 16384 > 655 and > 128), no AMP107. The loss
is finite on every step and decreases (45.9 -> 1.07), unscaled total grad norm 1.9..9.8
(< 100: no AMP104; > 1e-6 and every parameter's max |grad| >= 0.02: no AMP105), and at
scales >= 16384 not one nonzero scaled gradient is below 2**-20 on the judged steps (so
nothing near fp16's 2**-24 floor: no AMP106). Linear/GELU under autocast, loss in fp32:
no low-precision adds or reductions (no AMP110/AMP111).
"""
import json

import torch
from torch import nn

import amp_runtime

STEPS = 600
D_IN, N_TARGETS = 32, 16


def build():
    teacher = nn.Sequential(nn.Linear(D_IN, 64), nn.Tanh(), nn.Linear(64, N_TARGETS))
    model = nn.Sequential(
        nn.Linear(D_IN, 128), nn.GELU(),
        nn.Linear(128, 128), nn.GELU(),
        nn.Linear(128, N_TARGETS),
    )
    return teacher, model


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    teacher, model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=150)

    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(STEPS):
            x = torch.randn(256, D_IN)
            with torch.no_grad():
                y = teacher(x) * 6.0
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
                loss = (pred.float() - y).pow(2).sum(-1).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step % 200 == 0 or step == STEPS - 1:
                print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")

    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
