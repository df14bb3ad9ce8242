"""EXPECT: AMP001,AMP004
MAY: AMP106,AMP110,AMP111

FAULT: a deep, narrow tanh MLP (Linear(8, 16), 10 x Linear(16, 16), Linear(16, 1)) is trained in pure bf16
"to save memory": line 52 `model = model.to(torch.bfloat16)` casts the whole `nn.Sequential`
(module path: the root model) to bf16 inside the guard, with grad mode on, before step 0; the SGD
optimizer is then built over the bf16 parameters, so there is no fp32 master copy. The loss at
line 61, `(pred - y).pow(2).mean()`, reduces a bf16 tensor to a bf16 scalar outside autocast, on
every step (the watched steps 0-7 included). The numeric effect: SGD's update lr * grad
(1e-3 * 5e-4..1.3e-1) is below half a bf16 ulp of most weights (|w| 0.1-0.5, ulp 2^-10..2^-8), so
the update is absorbed and the network does not learn: in plain torch (no guard) after 60 steps
0-12 % of each weight matrix changed at all in bf16, 96-100 % in fp32.

Pages: AMP001 runtime sentence: "the guard reports a module, or a tensor that requires grad,
being cast to fp16/bf16 while grad mode is on" (the model cast, line 52). AMP004 runtime
sentence: "the guard reports a reduction whose input and output are both fp16/bf16" (`.mean()`
of a bf16 tensor, line 61). MAY: AMP110 (absorption) is exactly the mechanism of this fault, but
its page says it "Requires per-op checks (trace="always", or "auto" after an anomaly)" and this
run has no anomaly (no NaN/Inf, no scaler), while docs/index.md says the "sampled AMP110/AMP111
checks see every torch call only on watched steps" without that condition; AMP111 likewise for
the mean over squared errors that span more than 1e4 in magnitude. AMP106 estimates fp16 flushes
"at the current loss scale" every 32nd step; with bf16 gradients and no GradScaler the page does
not say whether it applies. Not expected: AMP105 (the smallest layer max |grad| is ~5e-4, total
norm ~0.5), AMP104, AMP010 (bf16, not fp16), any NaN/Inf code.
"""
import json

import torch
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

DEPTH, WIDTH = 10, 16
X = torch.randn(512, 8)
w_true = torch.randn(8, 1)
Y = torch.tanh(X @ w_true) * 0.5 + 0.05 * torch.randn(512, 1)


def make_mlp():
    layers = [nn.Linear(8, WIDTH), nn.Tanh()]
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, 1))
    return nn.Sequential(*layers)


with amp_runtime.guard(policy="record") as g:
    model = make_mlp()
    model = model.to(torch.bfloat16)  # INJECTED: pure bf16 weights, no fp32 master copy
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    initial = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    for step in range(60):
        idx = torch.randint(0, 512, (64,), generator=gen)
        x = X[idx].to(torch.bfloat16)
        y = Y[idx].to(torch.bfloat16)
        pred = model(x)
        loss = (pred - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}")

changed = [(p.detach() != p0).float().mean().item() for p, p0 in zip(model.parameters(), initial)]
print("fraction of each weight matrix that changed:", [round(c, 2) for c in changed[::2]])
for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
