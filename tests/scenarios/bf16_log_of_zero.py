"""EXPECT: AMP101,AMP103,AMP112
MAY: AMP110
FAULT: a binary classifier trained in CPU autocast bfloat16 without a GradScaler (correct for
bf16) with a hand-written BCE loss module, `target * log(p) + (1 - target) * log(1 - p)` on
`p = sigmoid(logits)` computed in bf16.  bf16 has 8 significant bits: once a logit passes
~6.2, sigmoid rounds to exactly 1.0, `1 - p` is 0 and `torch.log(1 - p)` is -inf; times
`(1 - target) = 0` it is NaN.  Nothing is injected by hand: the logits grow as the model
becomes confident (SGD lr=0.2) and at step 14 one sample's p rounds to 1.0 (checked with
plain torch below).  Without a scaler the NaN gradients are applied: every weight is NaN
from step 15 on, and every later loss is NaN.
Why these codes (quotes from docs/rules):
- AMP101 "the first op whose output holds NaN or Inf while all of its inputs were finite" ->
  `log` in the loss module at the `torch.log(1 - p)` line, step 14, found by the replay
  ("replays that step's forward with per-op checks"; the loss is a root module call, so it
  is replayed).  Not again later: "Later NaNs that merely propagate from it are not
  reported again" (from step 15 the weights themselves are NaN).
- AMP103 "NaN/Inf gradients that reached an optimizer step without a GradScaler catching
  them" -> step 14 ("reported when non-finite gradients start ... not again at every step
  of a run whose weights stay NaN").
- AMP112 "reports when it is NaN or Inf" -> steps 14..29 ("AMP112 reports each NaN loss").
MAY: AMP110 -- `1 - p` in bf16 with p ~ 1e-3 (large negative logits) really absorbs p
("adding a value more than about ... 256 times smaller ... in bf16"); the page makes it a
sampled per-op check, on only after an anomaly, so whether it is seen is left open.
Must NOT fire: AMP003 (no F.binary_cross_entropy / nn.BCELoss), AMP010 ("bf16 autocast with
no scaler" is fine), AMP002 (the loss runs inside the autocast block), AMP004 (the loss
upcasts with `.float()` before `mean`), AMP104 (gradient norms before step 14 are < 10,
checked below; at step 14 the norm is NaN), AMP105, AMP106, AMP107-109 (no scaler).
"""
import contextlib
import json
import math
import traceback

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS = 30


class LogLoss(nn.Module):
    """Binary log-loss written out by hand (a port of an old numpy metric)."""

    def forward(self, logits, target):
        p = torch.sigmoid(logits)
        ll = target * torch.log(p) + (1 - target) * torch.log(1 - p)
        return -ll.float().mean()


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 1))


gen = torch.Generator().manual_seed(1)
X = torch.randn(STEPS, 64, 16, generator=gen)
W_TRUE = torch.randn(16, generator=gen)
Y = (X @ W_TRUE > 0).float().unsqueeze(-1)


def train(model, probe=None, log=None):
    criterion = LogLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = X[step], Y[step]
        with probe(step) if probe else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
                loss = criterion(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if log is not None:
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            p1 = int((torch.sigmoid(logits) == 1).sum())
            log.append((step, loss.item(), float(grads.norm()), bool(torch.isfinite(grads).all()), p1))
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


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

    def __init__(self, step, hits):
        super().__init__()
        self.step, self.hits = step, hits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = list(_tensors(out))
        if outs and not all(_finite(t) for t in outs) and all(_finite(t) for t in _tensors((args, kwargs))):
            line = [f.lineno for f in traceback.extract_stack()[:-1] if f.filename == __file__][-1]
            self.hits.append((self.step, getattr(func, "__name__", str(func)), line))
        return out


def precheck():
    hits, log = [], []
    train(build(), probe=lambda step: FirstNonFinite(step, hits), log=log)
    for step, loss, norm, finite, p1 in log:
        print(f"PRECHECK step {step:2d} loss {loss:.4f} grad-norm {norm:.3g} grads finite {finite} p==1.0: {p1}")
    print("PRECHECK finite->non-finite ops:", hits)
    first_nan = next(s for s, l, _, _, _ in log if math.isnan(l))
    assert first_nan == 14 and [h[:2] for h in hits] == [(14, "log")], hits
    assert max(n for s, _, n, _, _ in log if s < 14) < 100


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    precheck()
    ref_losses, ref_weights = train(build())
    model = build()
    with amp_runtime.guard(policy="record") as g:
        losses, weights = train(model)
    print("LOSSES_MATCH", len(losses) == len(ref_losses) and all(same(a, b) for a, b in zip(losses, ref_losses)))
    print("WEIGHTS_MATCH", weights.keys() == ref_weights.keys() and all(same(weights[k], ref_weights[k]) for k in weights))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} :: {e.message}")
    print("COUNTS", json.dumps(g.report.to_json().get("counts", {}), sort_keys=True))
    print("EVENTS", json.dumps(sorted(set(g.report.codes()))))


if __name__ == "__main__":
    main()
