"""EXPECT: AMP109
FAULT: fp16 autocast regression with a torch.amp.GradScaler whose growth_interval was
lowered from the default 2000 to 10 "so the scale recovers quickly after an overflow".
This model's scaled gradients fit fp16 only up to a scale of about 2**14..2**18: after
the two start-up skips (steps 0 and 1, 65536 -> 16384) the scaler doubles the scale after
every 10 good steps until the scaled backward overflows, the step is skipped and the scale
halves, and this never stops: 44 of the 598 steps after the first good step (step 2) are
skipped, one in ~13.6 (gaps of 2..21 steps). AMP109's window of 100 steps is full from
step 101 on (counted from the first step the scaler did not skip), and from then on every
window holds 5..10 skipped steps (5..10 %, far above AMP109's 1 %); 39 of those skipped
steps each end a window above 1 % while being skipped themselves ("rising: the step just
taken was skipped", docs/rules/AMP109.md).
Not AMP108: after the first good step the scale never falls twice in a row (each skip is
followed by good steps: at most 1 decrease in a row, at most 2 without an increase in
between, never more than a factor 4 below its running peak), its lowest value is 16384
(> 65536/100 = 655 and > 128); not AMP107 (scale >= 16384). The forward stays finite on
every step (fp16 module outputs <= 11.1: no AMP101/AMP102/AMP112); only the scaled backward
overflows, and the scaler catches it (not AMP103). Unscaled total grad norm 1.9..9.8 (no
AMP104), every parameter's max |grad| >= 0.024 (no AMP105), and at scales >= 16384 no
nonzero scaled gradient is below 2**-20 on the judged steps (no AMP106). Linear/GELU only,
the loss is computed in fp32 (no fp16 add or reduction: no AMP110/AMP111).
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
    # "recover the scale quickly after an overflow" -- the scaler now climbs back into
    # overflow every ~11 steps, for the whole run
    scaler = torch.amp.GradScaler("cpu", growth_interval=10)

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
