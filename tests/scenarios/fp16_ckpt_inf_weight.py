"""EXPECT: AMP107,AMP108,AMP112
MAY: none
FAULT: an fp16 fine-tuning run (CPU autocast float16 + GradScaler, AdamW) resumes from a
checkpoint that was compacted for storage with `{k: v.half() for k, v in sd.items()}`.  The
pretraining run had written one overflowed value into `backbone.2.weight[7, 3]`, so the fp16
checkpoint holds +inf there BEFORE step 0 (injected at module level, outside every run;
`load_state_dict` copies it into the fp32 parameter).  Every forward therefore meets a
non-finite weight: the second Linear's output holds inf/NaN, the loss is NaN at every
backward, every gradient is NaN, GradScaler skips every step and halves its scale
65536 -> 0.0039 over 24 steps (checked with plain torch below, before any guarded run).
Why these codes (quotes from docs/rules):
- AMP112 "Checks the tensor that `backward()` starts from and reports when it is NaN or Inf"
  -> every step 0..23, at the `scaler.scale(loss).backward()` line.
- AMP108 "a scale below 1/100 of its initial value, or a scale below 128 that is still
  falling" -> the scale is 512 after the update of step 6 (< 655.36), 64 after step 9.
- AMP107 "reports when it is at or below 1 and not rising" -> scale 1.0 after the update of
  step 15, lower after.
Must NOT fire:
- AMP101: its page says "the first op whose output holds NaN or Inf while all of its inputs
  were finite" and "Later NaNs that merely propagate from it are not reported again".  No op
  here turns finite inputs into inf: the first non-finite output is `linear` whose weight
  input already holds inf.  (The guard has no code for "a parameter is non-finite"; a
  correct guard names no op here.)
- AMP103: "Steps that a GradScaler skips because of inf/NaN gradients are not AMP103".
- AMP109: "The window must be full first, counted from the first step the scaler did not
  skip" -> no step is ever taken.
- AMP104/AMP105/AMP106: the gradient norm is NaN (not > 100, not < 1e-6) and no gradient is
  finite; nothing here is an explosion, vanishing or an underflow.
- AMP001/AMP002/AMP010: loss is computed inside autocast on `.float()` logits, a scaler is
  used, the fp16 compaction runs before the guard under no_grad on a state-dict copy.
"""
import io
import json
import math
import sys
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS = 24
BAD = ("backbone.2.weight", (7, 3))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.backbone(x))


def build():
    torch.manual_seed(0)
    return Classifier()


# --- the "pretraining" checkpoint, compacted to fp16 for storage (made once, before any run)
with torch.no_grad():
    pretrained = build()
    compact = {k: v.half() for k, v in pretrained.state_dict().items()}
    compact[BAD[0]][BAD[1]] = float("inf")  # what the pretraining run's last step left there
CKPT = io.BytesIO()
torch.save(compact, CKPT)

gen = torch.Generator().manual_seed(1)
X = torch.randn(STEPS, 32, 20, generator=gen)
Y = torch.randint(0, 5, (STEPS, 32), generator=gen)


def load_model():
    model = build()
    CKPT.seek(0)
    state = torch.load(CKPT, weights_only=True)
    model.load_state_dict(state)  # copies fp16 values (inf included) into fp32 params
    return model


def train(model, log=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(STEPS):
        x, y = X[step], Y[step]
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.detach().clone())
        if log is not None:
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            log.append((step, loss.item(), before, scaler.get_scale(), bool(torch.isfinite(grads).all())))
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

    def __init__(self):
        super().__init__()
        self.first_nonfinite_output = None
        self.finite_to_nonfinite = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = list(_tensors(out))
        if outs and not all(_finite(t) for t in outs):
            line = [f.lineno for f in traceback.extract_stack()[:-1] if f.filename == __file__][-1]
            name = getattr(func, "__name__", str(func))
            if self.first_nonfinite_output is None:
                self.first_nonfinite_output = (name, line)
            if all(_finite(t) for t in _tensors((args, kwargs))):
                self.finite_to_nonfinite.append((name, line))
        return out


def precheck():
    model = load_model()
    w = dict(model.named_parameters())[BAD[0]]
    print("PRECHECK weight", BAD, "=", w[BAD[1]].item(), "finite params before step 0:",
          all(bool(torch.isfinite(p).all()) for n, p in model.named_parameters() if n != BAD[0]))
    probe = FirstNonFinite()
    with probe:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(X[0])
            loss = F.cross_entropy(logits.float(), Y[0])
    print("PRECHECK first non-finite output:", probe.first_nonfinite_output,
          "| ops turning finite inputs non-finite:", probe.finite_to_nonfinite)
    assert not probe.finite_to_nonfinite, "the fault must be a propagated inf, not a new one"
    log = []
    train(load_model(), log)
    for step, loss, before, after, finite in log:
        print(f"PRECHECK step {step:2d} loss {loss} scale {before} -> {after} grads finite {finite}")
    assert all(math.isnan(l) for _, l, _, _, _ in log)
    assert all(after < before for _, _, before, after, _ in log), "every step must be skipped"
    first_below_100th = next(s for s, _, _, a, _ in log if a < 65536 / 100)
    first_le_1 = next(s for s, _, _, a, _ in log if a <= 1)
    print("PRECHECK scale < init/100 after step", first_below_100th, "; <= 1 after step", first_le_1)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    precheck()
    ref_losses, ref_weights = train(load_model())
    model = load_model()
    with amp_runtime.guard(policy="record", model=model) as g:
        losses, weights = train(model)
    print("LOSSES_MATCH", len(losses) == len(ref_losses) and all(same(a, b) for a, b in zip(losses, ref_losses)))
    print("WEIGHTS_MATCH", weights.keys() == ref_weights.keys() and all(same(weights[k], ref_weights[k]) for k in weights))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} :: {e.message}")
    print("COUNTS", json.dumps(g.report.to_json().get("counts", {}), sort_keys=True))
    print("EVENTS", json.dumps(sorted(set(g.report.codes()))))


if __name__ == "__main__":
    main()
