"""EXPECT: AMP110
MAY: AMP001
FAULT: small CNN image classifier trained in bf16 autocast (fp32 weights, no scaler -
correct), with an EMA copy of the weights for evaluation. To halve its memory the EMA
copy is kept in bf16 (`ema = deepcopy(model).eval().requires_grad_(False)
.to(torch.bfloat16)`, first line inside the guard, before step 0) and updated after
every optimizer step, from step 0, at line 71, marked `# <-- FAULT`:
`p_ema.mul_(0.999).add_(p * (1 - 0.999))` in bf16. bf16 keeps 8 significant bits: the
increment (1e-3 of a weight) is ~1000x smaller than the EMA weight it is added to, far
beyond 2^8, so the add returns the EMA weight (rounded), and the EMA follows rounding
noise instead of the model (checked with plain torch, no guard: against an fp32 EMA kept
for the printout, the bf16 EMA misses 73-92% of the movement; its accuracy stays near
chance while the training loss falls from 2.3 to 0.6).
Why these codes (from the pages): AMP110 = "an fp16/bf16 add where one operand is wholly
absorbed (|a|/|b| beyond the mantissa)"; its page's example is a bf16 running sum and
says EMA updates kept in low precision "silently stop accumulating". It needs per-op
checks, so this run uses trace="always" (every step traced; one add in 16 sampled;
6 bf16 EMA adds per step x 60 steps). MAY AMP001: the EMA copy is cast to bf16 while
grad mode is on, but it is frozen first (`requires_grad_(False)`); the runtime text
("a module, or a tensor that requires grad, being cast") does not say whether a frozen
module counts, and a frozen teacher is silent for the linter. No other code: bf16 needs
no scaler, nothing overflows, the model has no explicit low-precision reductions
(pooling is `adaptive_avg_pool2d`, not a listed reduction).
"""
import copy
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DECAY = 0.999


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def batch(n=32):
    y = torch.randint(0, 10, (n,))
    x = torch.randn(n, 3, 16, 16)
    x[torch.arange(n), y % 3] += y[:, None, None].float() / 5.0   # a class signal
    return x, y


model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

with amp_runtime.guard(policy="record", trace="always") as g:
    ema = copy.deepcopy(model).eval().requires_grad_(False).to(torch.bfloat16)
    ema_start = [p.detach().clone() for p in ema.parameters()]
    ema_ref = copy.deepcopy(model).eval().requires_grad_(False)   # fp32 EMA, for the printout only
    for step in range(60):
        x, y = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), model.parameters()):
                p_ema.mul_(DECAY).add_(p.detach().to(p_ema.dtype) * (1 - DECAY))  # <-- FAULT
            for p_ref, p in zip(ema_ref.parameters(), model.parameters()):
                p_ref.lerp_(p.detach(), 1 - DECAY)
        if step % 20 == 19:
            with torch.no_grad():
                xv, yv = batch(64)
                acc = (ema(xv.to(torch.bfloat16)).argmax(-1) == yv).float().mean().item()
                err = sum((a.float() - b).pow(2).sum() for a, b in zip(ema.parameters(), ema_ref.parameters())).sqrt()
                moved = sum((b - c.float()).pow(2).sum() for b, c in zip(ema_ref.parameters(), ema_start)).sqrt()
            print(f"step {step} loss {loss.item():.4f} bf16-ema acc {acc:.3f}"
                  f" |bf16 ema - fp32 ema| / |fp32 ema movement| = {(err / moved).item():.2f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
