"""EXPECT: AMP101,AMP108,AMP112
MAY: none
FAULT: a tabular scoring MLP wrapped in `torch.compile(model)` (inductor, the default
backend) trains in CPU autocast float16 with a GradScaler.  Every 4th batch (steps 3, 7,
..., 39) comes from a legacy feed whose `amount` column (feature 0) is in raw cents
(1e5..1e6) instead of z-scores.  On those batches the first Linear (`inp`) returns inf in
fp16 (autocast casts its fp32 input, already beyond 65504, to fp16 inside the op; the
compiled graph does the same as eager), the GELU after it turns -inf into NaN, the loss is NaN, GradScaler skips the step and halves
the scale: 10 skips in 40 steps, 65536 -> 64 (checked with plain torch below, compiled and
eager, before any guarded run).
Why these codes (quotes from docs):
- AMP112 "Checks the tensor that `backward()` starts from and reports when it is NaN or
  Inf" -> steps 3, 7, ..., 39.
- AMP101 "the first op whose output holds NaN or Inf while all of its inputs were finite"
  -> `linear` in module `inp`, at the `self.inp(x)` line of `forward`, step 3.  index.md,
  torch.compile: "The replay of a failing step runs the compiled model's original module
  eagerly"; "Names leave out torch.compile's `_orig_mod`".
- AMP108 "a scale below 1/100 of its initial value, or a scale below 128 that is still
  falling" -> 512 after the skip of step 27, 64 after step 39.
Raw cents are beyond 65504 already, so autocast's fp16 cast of the input inside `linear`
overflows: the first op seen with finite (fp32) inputs and a non-finite output is `linear`;
no finite value above 60000 appears anywhere (counted below: 0), so AMP102 has nothing to
report.
Must NOT fire: AMP102 (see above), AMP103 ("Steps that a GradScaler skips ... are not AMP103"), AMP107 (the
scale never reaches 1), AMP109 (its 100-step window is never full), AMP104 (good steps have
small gradient norms; checked), AMP008 ("What torch.compile runs while it compiles ... is
not reported"), AMP100, AMP002/AMP010 (loss inside autocast, scaler used).
"""
import json
import math
import os
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS = 40
BACKEND = os.environ.get("SCENARIO_BACKEND", "inductor")


class Scorer(nn.Module):
    def __init__(self, n_features=12, width=48):
        super().__init__()
        self.inp = nn.Linear(n_features, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        h = F.gelu(self.hidden(h))
        return self.out(h)


def build():
    torch.manual_seed(0)
    return Scorer()


gen = torch.Generator().manual_seed(1)
X = torch.randn(STEPS, 64, 12, generator=gen)
Y = (X[..., 1] + 0.5 * X[..., 2] - X[..., 0] > 0).float().unsqueeze(-1)
LEGACY = [s for s in range(STEPS) if s % 4 == 3]
for s in LEGACY:  # the legacy feed: amount in raw cents, not standardised
    X[s, :, 0] = torch.rand(64, generator=gen) * 9e5 + 1e5


def train(model, log=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(STEPS):
        x, y = X[step], Y[step]
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        if log is not None:
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            norm = float(grads.float().norm()) / before
        scaler.step(optimizer)
        scaler.update()
        if log is not None:
            log.append((step, loss.item(), before, scaler.get_scale(), norm))
        losses.append(loss.detach().clone())
    return losses, {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- plain-torch checks
def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _finite(t):
    return (not t.is_floating_point()) or bool(torch.isfinite(t).all())


class FirstNonFinite(TorchFunctionMode):
    """Plain torch: ops whose output is non-finite while every tensor input is finite."""

    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = list(_tensors(out))
        if outs and not all(_finite(t) for t in outs) and all(_finite(t) for t in _tensors((args, kwargs))):
            line = [f.lineno for f in traceback.extract_stack()[:-1] if f.filename == __file__][-1]
            self.hits.append((getattr(func, "__name__", str(func)), line))
        return out


def precheck():
    model = build()  # eager, one bad batch, op by op
    probe = FirstNonFinite()
    with probe, torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        pre = model.inp(X[3])
        model(X[3])
    near = int(((pre.abs() > 60000) & torch.isfinite(pre)).sum())
    print("PRECHECK step 3 eager: finite->non-finite ops", probe.hits[:3], "| inp outputs inf:",
          int(torch.isinf(pre).sum()), "in (60000, 65504]:", near)
    assert probe.hits[0][0] == "linear"
    for label, make in (("eager", build), ("compiled", lambda: torch.compile(build(), backend=BACKEND))):
        torch._dynamo.reset()
        log = []
        train(make(), log)
        skipped = [s for s, _, b, a, _ in log if a < b]
        nan_loss = [s for s, l, _, _, _ in log if not math.isfinite(l)]
        print(f"PRECHECK {label}: skipped {skipped}; non-finite loss {nan_loss}; final scale {log[-1][3]}; "
              f"max unscaled grad norm of good steps {max(n for s, _, _, _, n in log if s not in skipped):.3g}")
        assert skipped == LEGACY and nan_loss == LEGACY


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    precheck()
    torch._dynamo.reset()
    ref_losses, ref_weights = train(torch.compile(build(), backend=BACKEND))
    torch._dynamo.reset()
    with amp_runtime.guard(policy="record") as g:
        losses, weights = train(torch.compile(build(), backend=BACKEND))
    print("LOSSES_MATCH", len(losses) == len(ref_losses) and all(same(a, b) for a, b in zip(losses, ref_losses)))
    print("WEIGHTS_MATCH", weights.keys() == ref_weights.keys() and all(same(weights[k], ref_weights[k]) for k in weights))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} :: {e.message}")
    print("COUNTS", json.dumps(g.report.to_json().get("counts", {}), sort_keys=True))
    print("EVENTS", json.dumps(sorted(set(g.report.codes()))))


if __name__ == "__main__":
    main()
