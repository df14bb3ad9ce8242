"""EXPECT: none
HEALTHY: a 2-block pre-norm transformer-style sequence classifier wrapped in
`torch.compile(model, backend="aot_eager")` (no C++ toolchain needed), trained in bf16
autocast with no GradScaler (correct for bf16), AdamW, 40 steps, with an evaluation of
the compiled model under `torch.no_grad()` + `model.eval()` every 10 steps (a
recompilation for eval mode) and back to `model.train()`. Pooling over the sequence is
done in fp32 (`h.float().mean(1)`), the idiomatic upcast, so no bf16 reduction exists
even in the compiled graph. Checked with plain torch, no guard: finite losses, runs in
~4 s.
Why no code (from the pages): bf16 without a scaler is right (AMP010 only flags fp16
without a scaler or a scaler with bf16); the loss is inside autocast (AMP002); no
manual cast (AMP001); README/index: "torch.compile work[s] as without it", the guard
"compiles nothing extra", step-level checks go on and the per-op checks stop at the
first compilation; "What the compiler runs while compiling is not judged as your code"
(AMP008 page, for AOTAutograd tracing the backward in the autocast region). Nothing is
non-finite, gradient norms are O(1).
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class SeqClassifier(nn.Module):
    def __init__(self, n_in=20, d=64, n_cls=5):
        super().__init__()
        self.embed = nn.Linear(n_in, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_cls)

    def forward(self, x):
        h = self.ln_f(self.blocks(self.embed(x)))
        return self.head(h.float().mean(dim=1))     # pool in fp32


prototypes = torch.randn(5, 20)


def batch(n=16, length=12):
    y = torch.randint(0, 5, (n,))
    x = prototypes[y][:, None, :] * 0.5 + torch.randn(n, length, 20)
    return x, y


model = SeqClassifier()
compiled = torch.compile(model, backend="aot_eager")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x_val, y_val = batch(64)

with amp_runtime.guard(policy="record") as g:
    for step in range(40):
        x, y = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 9:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                acc = (compiled(x_val).argmax(-1) == y_val).float().mean().item()
            model.train()
            print(f"step {step} loss {loss.item():.4f} val acc {acc:.3f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
