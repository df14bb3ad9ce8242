"""EXPECT: AMP101
MAY: none
FAULT: a 10-class MLP classifier (body.0, body.2, head) whose forward returns
`torch.log(probs)` with `probs = head(...).softmax(-1)` (line marked FAULT LINE in
ProbClassifier.forward) instead of log_softmax; fp16 autocast on the CPU (where softmax and log
stay fp16), F.nll_loss inside the region, Adam, GradScaler("cpu"), 60 steps. At step 52 the batch
holds one prototypical sample (row 5, the class centre times 8). Measured with `--plain`: its
fp32 logit spread is 23.2, its smallest fp32 probability 8.2e-11, below fp16's 2.98e-8 rounding
threshold, so 7 of its fp16 probabilities are exactly 0 and torch.log gives -inf there (no zero
probability at any other step). nll_loss only picks the target column, so the loss stays finite
(0.773), but the backward of log divides the zero upstream gradient by p = 0 (0/0 = NaN) and every
parameter's gradient is NaN: GradScaler skips step 52 only (scale 65536 -> 32768) and the run goes
on. Per AMP101.md the guard (trace="auto") replays the skipped step and names the first op whose
output is non-finite with finite inputs: torch.log (the softmax output 0 is finite), in the root
module ProbClassifier (no submodule), at the `return torch.log(probs)` line, step 52. No AMP112
(finite loss), no AMP103 (the scaler caught it), no AMP107/108/109 (a single skip).
"""
import argparse
import json
import linecache
import math
import struct
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 60
EASY_STEP = 52          # the batch of this step holds one very easy (far from the boundary) sample
N_CLS, D_IN, BATCH = 10, 20, 32


class ProbClassifier(nn.Module):
    """Returns log-probabilities computed as log(softmax): the head keeps `probs` for calibration."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, N_CLS)

    def forward(self, x):
        probs = self.head(self.body(x)).softmax(dim=-1)   # fp16 under CPU autocast
        self.last_probs = probs.detach()
        return torch.log(probs)                            # <-- FAULT LINE: log(0) = -inf in fp16


def make_data():
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(N_CLS, D_IN, generator=g) * 1.5
    batches = []
    for step in range(STEPS):
        y = torch.randint(0, N_CLS, (BATCH,), generator=g)
        x = centers[y] + torch.randn(BATCH, D_IN, generator=g)
        if step == EASY_STEP:
            x[5] = centers[y[5]] * EASY_FACTOR        # a clean, prototypical sample, far from any boundary
        batches.append((x, y))
    return batches


EASY_FACTOR = 8.0


def run(guarded, inspect=None):
    torch.manual_seed(0)
    model = ProbClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    batches = make_data()
    losses, scales = [], []
    ctx = amp_runtime.guard(policy="record", model=model) if guarded else nullcontext()
    with ctx as g:
        for step, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logp = model(x)
                loss = F.nll_loss(logp, y)
            scaler.scale(loss).backward()
            if inspect is not None:
                inspect(step, model, scaler, loss, logp, x)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach().float().clone())
            scales.append(scaler.get_scale())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "scales": scales, "weights": weights, "guard": g}


def plain():
    rows = []

    def inspect(step, model, scaler, loss, logp, x):
        if step == EASY_STEP:
            with torch.no_grad():
                logits32 = model.head(model.body(x[5:6])).float()
                p32 = logits32.softmax(-1)
            print(f'easy sample at step {step}: fp32 logits gap max-min={(logits32.max() - logits32.min()).item():.2f}, '
                  f'fp32 min prob={p32.min().item():.3g} (fp16 smallest subnormal 5.96e-8; below 2.98e-8 rounds to 0)')
        p = model.last_probs
        zeros = (p == 0).nonzero().tolist()
        inf_grad = [n for n, q in model.named_parameters() if not torch.isfinite(q.grad).all()]
        nan_grad = [n for n, q in model.named_parameters() if torch.isnan(q.grad).any()]
        rows.append((step, loss.item(), scaler.get_scale(), p.min().item(), zeros, inf_grad, nan_grad,
                     torch.isinf(logp).sum().item()))

    r = run(guarded=False, inspect=inspect)
    for step, loss, s, pmin, zeros, inf_grad, nan_grad, ninf in rows:
        if step % 10 == 0 or zeros or inf_grad or step >= EASY_STEP - 2:
            print(f"step {step:2d} loss={loss:.4f} scale={s:g} min fp16 prob={pmin:.3g} zero probs (row,class)={zeros[:6]}"
                  f"{'...' if len(zeros) > 6 else ''} -inf in logp={ninf} non-finite grads in={inf_grad} (NaN: {bool(nan_grad)})")
    print("steps with an fp16 probability of exactly 0:", [x[0] for x in rows if x[4]])
    print("skipped steps:", [x[0] for x in rows if x[5]], "final scale", r["scales"][-1])
    print("losses all finite:", all(torch.isfinite(v) for v in r["losses"]))

# ----------------------------------------------------------------------------- harness
# (identical in every script of this batch: reference run, guarded run, bitwise comparison, events)
def _bits(t):
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)  # NaN == NaN
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _same_float(a, b):
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)


def _print_events(g):
    rep = g.report
    counts = rep.to_json().get("counts", {})
    codes = set(counts) | {e.code for e in rep.events}
    print(f"--- {len(rep.events)} events kept, {len(rep)} occurrences; counts {json.dumps(counts, sort_keys=True)}")
    for e in rep.events:
        src = e.source or ""
        text = ""
        f, _, ln = src.rpartition(":")
        if ln.isdigit():
            text = linecache.getline(f, int(ln)).strip()
        print(f"EVENT {e.code} [{e.severity}] step={e.step} module={e.module} op={e.op} line={src}")
        if text:
            print(f"    src: {text}")
        print(f"    msg: {e.message}")
        d = {k: e.details[k] for k in ("call", "calls", "replayed", "origin", "replay") if e.details and k in e.details}
        if d:
            print("    details: " + json.dumps(d, default=str)[:900])
    print(rep.summary())
    print("EVENTS " + json.dumps(sorted(codes)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true", help="check the fault with plain torch only")
    args = ap.parse_args()
    if args.plain:
        plain()
        return
    t0 = time.time()
    ref = run(guarded=False)
    t1 = time.time()
    got = run(guarded=True)
    t2 = time.time()
    losses_ok = len(ref["losses"]) == len(got["losses"]) and all(
        _same(a, b) for a, b in zip(ref["losses"], got["losses"]))
    scales_ok = len(ref["scales"]) == len(got["scales"]) and all(
        _same_float(a, b) for a, b in zip(ref["scales"], got["scales"]))
    weights_ok = ref["weights"].keys() == got["weights"].keys() and all(
        _same(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    print(f"reference run {t1 - t0:.2f}s, guarded run {t2 - t1:.2f}s")
    print(f"final loss ref={ref['losses'][-1].item():.6g} guarded={got['losses'][-1].item():.6g}; "
          f"final scale ref={ref['scales'][-1]} guarded={got['scales'][-1]}")
    print("LOSSES_MATCH", losses_ok and scales_ok, f"(losses {losses_ok}, loss scales {scales_ok})")
    print("WEIGHTS_MATCH", weights_ok)
    _print_events(got["guard"])


if __name__ == "__main__":
    main()
