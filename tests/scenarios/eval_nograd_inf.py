"""EXPECT: none

HEALTHY: a small classifier trained 20 steps with fp16 CPU autocast + GradScaler("cpu")
(healthy: no skipped step, finite losses and grads). Every 4 steps the loop evaluates,
nanoGPT style: `model.eval()`, `with torch.no_grad(), torch.autocast("cpu", fp16)`, then
`model.train()` (REAL_WORLD_IDIOMS: "estimate_loss() under torch.no_grad() and
model.eval() every N iterations"). The evaluation computes a calibration metric with a
temperature sweep written without max-subtraction: `torch.exp(logits / T)` in fp16
(`evaluate`, the line marked `# eval-only inf`) with T = 0.05, which overflows to inf as
soon as a logit passes 0.55 (checked with plain torch: 66..132 of the 768 fp16 values are
inf at every evaluation, from the first one on), then normalises in fp32: those rows become
NaN probabilities and silently drop out of the sharpened "ECE@T=0.05" metric. The inf never
reaches training: it lives in a no_grad, eval-only path and only the printed metric is
wrong.

Why it must be silent under the default trace="auto": AMP101.md "With trace="auto" (the
default) the guard runs cheap step-level checks until something goes non-finite (the loss
at backward, the gradients, a GradScaler skipping the step)" -- none of these ever goes
non-finite here, so per-op checks never switch on and nothing replays; index.md replay:
"Every call made with grad enabled keeps its inputs" and "code under torch.no_grad() ... [is]
not" replayed; AMP102/AMP110/AMP111 "Requires per-op checks". The eval path has no
code-pattern trigger: no fill constant (AMP007), no tiny epsilon (AMP011), its reductions
run on `.float()` values (AMP004), no cast of a module (AMP001), no backward. So no event.
Losses must equal an unguarded run.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS, BS, EVAL_EVERY = 20, 32, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 6))

    def forward(self, x):
        return self.net(x)


def make_data():
    gen = torch.Generator().manual_seed(21)
    proto = torch.randn(6, 16, generator=gen) * 2
    def batch(n):
        y = torch.randint(0, 6, (n,), generator=gen)
        return proto[y] + torch.randn(n, 16, generator=gen), y
    return [batch(BS) for _ in range(STEPS)], batch(128)


def ece(probs, y, bins=10):
    conf, pred = probs.max(-1)
    acc = (pred == y).float()
    edges = torch.linspace(0, 1, bins + 1)
    total = torch.zeros(())
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf > lo) & (conf <= hi)
        if m.any():
            total = total + m.float().mean() * (conf[m].mean() - acc[m].mean()).abs()
    return total.item()


def evaluate(model, val):
    x, y = val
    model.eval()
    out = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
        out["val_loss"] = F.cross_entropy(logits, y).item()
        for T in (1.0, 0.05):
            e = torch.exp(logits / T)  # eval-only inf: no max-subtraction, fp16 overflows at T=0.05
            probs = e.float() / e.float().sum(-1, keepdim=True)
            out[f"ece@T={T}"] = ece(probs, y)
            out[f"inf@T={T}"] = int(torch.isinf(e).sum())
    model.train()
    return out


def build():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, scaler


def train(model, opt, scaler, data, val):
    torch.manual_seed(1)
    losses, evals = [], []
    for step, (x, y) in enumerate(data):
        if step % EVAL_EVERY == 0:
            evals.append((step, evaluate(model, val)))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, evals


def same(a, b):
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


data, val = make_data()
ref_model, ref_opt, ref_scaler = build()
ref_losses, ref_evals = train(ref_model, ref_opt, ref_scaler, data, val)
print("unguarded losses", [round(v, 4) for v in ref_losses], "scale", ref_scaler.get_scale())
for step, ev in ref_evals:
    print("  eval", step, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ev.items()})

model, opt, scaler = build()
with amp_runtime.guard() as g:
    losses, evals = train(model, opt, scaler, data, val)

print("LOSSES_MATCH", same(ref_losses, losses),
      "EVAL_MATCH", str(evals) == str(ref_evals),
      "WEIGHTS_MATCH", all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters())),
      "SCALE", scaler.get_scale())
for e in g.report.events:
    print("EVENT", e.code, e.severity, e.step, e.module, e.op, e.source, e.message[:200])
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
