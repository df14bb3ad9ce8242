"""EXPECT: AMP101,AMP112
MAY: AMP102,AMP110,AMP111

FAULT: gradient accumulation (4 micro-batches per optimizer step, loss / ACCUM, the next
micro-batch fetched between forward and backward, unscale_ + clip + scaler.step/update once
per step), fp16 CPU autocast with torch.amp.GradScaler("cpu"). Only micro-batch 2 of step 6
(0-based) comes from a "shard whose standardisation was skipped": its features are x * 400
(`load_microbatch`, the line marked `# FAULT: raw shard`). In that one micro-batch the
DCN-v2 cross layer `cross.0` (CrossLayer.forward, the line `return x0 * self.lin(xl) + xl`,
marked `# FAULT OP`) multiplies two fp16 activations of ~900 and ~480: the product passes
65504 and is inf, while every input of that mul is finite (checked with plain torch: the
embed output peaks at 882, `lin` at 478, the product is inf in 105 entries). The loss of
that micro-batch is inf when its scaled backward starts, the GradScaler finds inf grads
at unscale_ and skips step 6 (scale 65536 -> 32768); the other 11 steps are finite.

Codes from the pages: AMP112 ("Checks the tensor that backward() starts from and reports
when it is NaN or Inf"); AMP101 (trace="auto": "then replays that step's forward with
per-op checks, so AMP101 names the op of the step where it happened"; the step has 4 root
calls of the model, all replayed, and the first non-finite op is the mul in cross.0 of the
third call). Not AMP103 (AMP103.md: "Steps that a GradScaler skips because of inf/NaN
gradients are not AMP103"), not AMP108 (one halving: not 5 consecutive decreases, not below
init/100, not below 128), not AMP109 (the 100-step window is never full). DESIGN:
"Gradient accumulation is judged once per step, not per micro-batch": the event step must
be 6. MAY: AMP102 (per-op checks in the replay and in the traced steps after it; the
overflowing mul's finite entries may pass 60000), AMP110/AMP111 (sampled per-op checks on
the traced steps after the anomaly; `+ xl` is an fp16 add).
The guarded run must give the same per-micro-batch losses and final weights as the
unguarded one (dropout included: the replay must restore the RNG).
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS, ACCUM, MICRO_BS = 12, 4, 16
BAD_STEP, BAD_MICRO = 6, 2


class CrossLayer(nn.Module):
    """DCN-v2 cross layer: x_{l+1} = x0 * (W x_l + b) + x_l."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x0, xl):
        return x0 * self.lin(xl) + xl  # FAULT OP: fp16 product overflows on the raw micro-batch


class DCN(nn.Module):
    def __init__(self, n_in=32, d=64, n_cls=5):
        super().__init__()
        self.embed = nn.Linear(n_in, d)
        self.cross = nn.ModuleList([CrossLayer(d) for _ in range(2)])
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(0.1), nn.Linear(d, n_cls))

    def forward(self, x):
        x0 = self.embed(x)
        xl = x0
        for layer in self.cross:
            xl = layer(x0, xl)
        return self.mlp(xl)


def make_data():
    gen = torch.Generator().manual_seed(1234)
    teacher = torch.randn(32, 5, generator=gen)
    data = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x = torch.randn(MICRO_BS, 32, generator=gen)
            y = (x @ teacher).argmax(-1)
            data.append((step, micro, x, y))
    return data


def load_microbatch(step, micro, x):
    if step == BAD_STEP and micro == BAD_MICRO:
        return x * 400.0  # FAULT: raw shard, standardisation skipped
    return x


def loader(data):
    for step, micro, x, y in data:
        yield load_microbatch(step, micro, x), y


def build():
    torch.manual_seed(0)
    model = DCN()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, scaler


def train(model, opt, scaler, data):
    torch.manual_seed(1)  # dropout stream
    losses, scales = [], []
    it = loader(data)
    x, y = next(it)
    model.train()
    for step in range(STEPS):
        for micro in range(ACCUM):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = F.cross_entropy(logits, y) / ACCUM
            nxt = next(it, None)  # the loader is fetched between forward and backward
            scaler.scale(loss).backward()
            losses.append(loss.item())
            if nxt is not None:
                x, y = nxt
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return losses, scales


def same(a, b):
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


def same_weights(m1, m2):
    return all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m2.state_dict().values()))


def dump(g):
    for e in g.report.events:
        d = e.details or {}
        extra = {k: d[k] for k in ("replayed", "origin", "replay", "call", "call_index") if k in d}
        print(f"EVENT {e.code} sev={e.severity} step={e.step} module={e.module!r} op={e.op!r} "
              f"source={e.source!r} extra={str(extra)[:400]}")
        print(f"      msg={e.message[:300]!r}")


data = make_data()
ref_model, ref_opt, ref_scaler = build()
ref_losses, ref_scales = train(ref_model, ref_opt, ref_scaler, data)
bad = BAD_STEP * ACCUM + BAD_MICRO
print("unguarded: non-finite micro-batch losses at", [i for i, v in enumerate(ref_losses) if not math.isfinite(v)],
      "(expected only", bad, ") scales", ref_scales)

model, opt, scaler = build()
with amp_runtime.guard(model=model) as g:
    losses, scales = train(model, opt, scaler, data)

print("guarded scales", scales)
print("LOSSES_MATCH", same(ref_losses, losses), "WEIGHTS_MATCH", same_weights(ref_model, model),
      "SCALES_MATCH", ref_scales == scales)
dump(g)
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
