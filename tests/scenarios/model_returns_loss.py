"""EXPECT: AMP011,AMP101,AMP112
MAY: AMP102,AMP110

FAULT: the model computes its own loss, Hugging-Face style: `logits, loss = model(x, y)`
(forward returns `(logits, loss)`; the loss is a submodule `criterion`, a hand-written
label-smoothing cross-entropy), trained with fp16 CPU autocast + GradScaler("cpu"); after
the autocast block the loop only scales, steps and logs `loss.item()`. The fault is in
the loss: `torch.log(probs + 1e-8)` on the fp16 softmax output (SmoothedCE.forward, line
marked `# FAULT: tiny eps`): 1e-8 is below fp16's smallest subnormal 5.96e-8 and flushes to
zero, so the guard never guards. Every step runs that add (steps 0.. are watched). At step
5 (0-based) one sample in the batch has unnormalised features (`make_data`, the line
marked `# FAULT: unnormalised sample`, x * 200): its logits spread by ~46, its fp16 softmax
underflows to exactly 0 for some classes, `0 + 1e-8` is 0 in fp16 and `torch.log`
(line marked `# FAULT OP`) returns -inf from finite inputs (checked with plain torch: only
step 5 has a non-finite loss; probs and logits are finite there). The smoothed loss (every
class gets weight eps/n) is inf, the GradScaler skips step 5.

Codes from the pages: AMP011 (runtime: "At run time the guard reports an epsilon that
flushes to zero in the dtype of the tensor it is added to"; a code-pattern rule seen on
watched steps, "the first Thresholds.watch_steps (default 8)": from step 0, at the `+ 1e-8`
line, module `criterion`), AMP101 (trace="auto" replay of step 5: `log` in `criterion`;
index.md replay: "Only root module calls are replayed" -- the loss runs inside the root
module here, so it is replayed), AMP112 (loss inf at backward). Not AMP103 (scaler
skips). REAL_WORLD_IDIOMS 6 "Losses produced inside the forward ... model(x, y) returning
(logits, loss)" is idiomatic: no AMP002. The loss reductions run on `logp.float()`: no
AMP004. MAY: AMP110 (the fp16 add `probs + 1e-8` absorbs its tiny operand; AMP110 needs
per-op checks, which are on after the step-5 anomaly, and samples 1 call in 16), AMP102
(per-op checks after the anomaly; no value near 60000 is expected).
Losses and weights must equal an unguarded run.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS, BS, N_IN, N_CLS, BAD_STEP = 12, 32, 20, 10, 5


class SmoothedCE(nn.Module):
    def __init__(self, eps=0.1):
        super().__init__()
        self.eps = eps

    def forward(self, logits, target):
        probs = torch.softmax(logits, dim=-1)
        logp = torch.log(  # FAULT OP: log(0) = -inf once the eps has flushed
            probs + 1e-8)  # FAULT: tiny eps, 0 in fp16
        n = logits.size(-1)
        soft = torch.full(logp.shape, self.eps / n, dtype=torch.float32)
        soft.scatter_(1, target[:, None], 1.0 - self.eps + self.eps / n)
        return -(soft * logp.float()).sum(-1).mean()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, N_CLS)
        self.criterion = SmoothedCE()

    def forward(self, x, labels=None):
        logits = self.head(self.body(x))
        loss = self.criterion(logits, labels) if labels is not None else None
        return logits, loss


def make_data():
    gen = torch.Generator().manual_seed(3)
    proto = torch.randn(N_CLS, N_IN, generator=gen)
    out = []
    for step in range(STEPS):
        y = torch.randint(0, N_CLS, (BS,), generator=gen)
        x = proto[y] + 0.8 * torch.randn(BS, N_IN, generator=gen)
        if step == BAD_STEP:
            x[3] = x[3] * 200.0  # FAULT: unnormalised sample
        out.append((x, y))
    return out


def build():
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, scaler


def train(model, opt, scaler, data):
    losses = []
    model.train()
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            logits, loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def same(a, b):
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


def fmt(e):
    d = e.details or {}
    return (f"{e.code} sev={e.severity} step={e.step} module={e.module!r} op={e.op!r} source={e.source!r} "
            f"details={str({k: d[k] for k in sorted(d) if k != 'traceback'})[:500]}")


data = make_data()
ref_model, ref_opt, ref_scaler = build()
ref_losses = train(ref_model, ref_opt, ref_scaler, data)
print("unguarded losses", [round(v, 4) for v in ref_losses], "scale", ref_scaler.get_scale())

model, opt, scaler = build()
with amp_runtime.guard(model=model) as g:
    losses = train(model, opt, scaler, data)

print("LOSSES_MATCH", same(ref_losses, losses),
      "WEIGHTS_MATCH", all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters())),
      "SCALE", scaler.get_scale(), "len(report)", len(g.report))
for e in g.report.events:
    print("EVENT", fmt(e))
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
