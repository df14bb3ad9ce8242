"""EXPECT: none

HEALTHY: a CPU-only binary classifier (MLP, `nn.BCELoss()` on `torch.sigmoid(logits)`)
trained 16 steps with fp16 CPU autocast + GradScaler("cpu"). The BCE runs inside the
autocast block (`train_step`, the line marked `# accepted AMP003`): that is AMP003's
pattern, but on the CPU it is harmless (AMP003.md: "CPU autocast has it on its float32 list
and runs it"; REAL_WORLD_IDIOMS 7: CPU autocast's `binary_cross_entropy` runs in fp32), and
this CPU-only project accepts it. Numerics are healthy: no skipped step, logits stay far
below the 8.3 where an fp16 sigmoid rounds to 1, no value near 60000.

Two guards, nested, with different filters:
- outer `guard(ignore=["AMP003"])` around all 16 steps;
- inner `guard(select=["AMP1"], trace="always")` around steps 8..15 (a "debug the second
  half" guard: numeric codes only, every op traced).
Before them, a sequential control guard with no filter runs 2 steps of a separate copy:
it must report AMP003 (printed as CONTROL, not part of EXPECT), which shows the filters
below have something to filter.

Why none: index.md "select / ignore: code prefixes as in flake8"; AMP003.md runtime
"the guard reports the same call made while autocast is on" -- the outer ignores it, the
inner does not select it (AMP003 does not start with "AMP1"); DESIGN 4 "Guards nest; the
inner one reports to the outer" -- the inner has nothing selected to report, and the outer
ignores AMP003 whoever reports it. The inner traces every op (AMP101/AMP102/AMP110/AMP111
see every op), and there is no non-finite value, no fp16 value near 60000, no fp16 add or
low-precision reduction in the model. The printed EVENTS are the outer guard's; INNER
prints the inner guard's (also expected empty). Losses must equal an unguarded run.
"""
import json
import math

import torch
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS, BS, SPLIT = 16, 64, 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def make_data(n):
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(24, generator=gen)
    out = []
    for _ in range(n):
        x = torch.randn(BS, 24, generator=gen)
        out.append((x, (x @ w > 0).float()))
    return out


def build():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, scaler


criterion = nn.BCELoss()


def train_step(model, opt, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        probs = torch.sigmoid(model(x))
        loss = criterion(probs, y)  # accepted AMP003: CPU autocast runs BCE in fp32
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.item()


def same(a, b):
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


def fmt(e):
    return f"{e.code} sev={e.severity} step={e.step} module={e.module!r} op={e.op!r} source={e.source!r}"


data = make_data(STEPS)

# sequential control guard, no filter, on a separate copy
c_model, c_opt, c_scaler = build()
with amp_runtime.guard(policy="record") as g0:
    for x, y in data[:2]:
        train_step(c_model, c_opt, c_scaler, x, y)
print("CONTROL " + json.dumps(sorted({e.code for e in g0.report.events})))

# unguarded reference
ref_model, ref_opt, ref_scaler = build()
ref_losses = [train_step(ref_model, ref_opt, ref_scaler, x, y) for x, y in data]
print("unguarded losses", [round(v, 4) for v in ref_losses], "scale", ref_scaler.get_scale())

model, opt, scaler = build()
losses = []
with amp_runtime.guard(policy="record", ignore=["AMP003"]) as g:
    for x, y in data[:SPLIT]:
        losses.append(train_step(model, opt, scaler, x, y))
    with amp_runtime.guard(policy="record", select=["AMP1"], trace="always") as inner:
        for x, y in data[SPLIT:]:
            losses.append(train_step(model, opt, scaler, x, y))

print("LOSSES_MATCH", same(ref_losses, losses),
      "WEIGHTS_MATCH", all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters())),
      "SCALE", scaler.get_scale())
for e in inner.report.events:
    print("INNER EVENT", fmt(e))
for e in g.report.events:
    print("OUTER EVENT", fmt(e))
print("INNER " + json.dumps(sorted({e.code for e in inner.report.events})))
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
