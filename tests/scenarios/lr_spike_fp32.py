"""EXPECT: AMP104
MAY: none
FAULT: an fp32 MLP regressor (0: Linear 16-64, 2: Linear 64-64, 4: Linear 64-1, ReLUs), no autocast,
no GradScaler, Adam, 50 steps, with a hand-written warm-up + cosine schedule assigned to
`param_groups[...]["lr"]` every step. The branch for the step that ends the warm-up returns
`PEAK_MULT` (10.0, meant as a multiple of BASE_LR 3e-3) as an absolute learning rate (line
marked FAULT LINE in lr_at): step 20 is taken with lr = 10.0. Measured with `--plain`: step 20's
gradients are ordinary (norm 1.15), Adam moves every weight by ~10 (max |w| 0.27 -> 11.5), and
from step 21 on the loss is ~1.6e11 and the total gradient norm ~1e10 (per-layer max |g| 6e8 /
1.7e8 / 2.1e9) at every step to the end (the lr is back to ~3e-3, too small to undo the jump);
everything stays finite in fp32 and no layer's gradients are all zero. Per AMP104.md: total
gradient norm > 1000, severity P0, first at step 21 (0-based; the step after the lr spike), at
the `optimizer.step()` line; the largest layer is `4` (the output Linear). The guard cannot see
the schedule itself, so the message's "lower the learning rate" is the right hint. No AMP103/
AMP112 (all finite), no AMP105 (no dead layer).
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

STEPS = 50
WARMUP = 20
BASE_LR = 3e-3
PEAK_MULT = 10.0      # the schedule's peak, as a multiple of BASE_LR
D_IN, BATCH = 16, 64


def lr_at(step):
    """Linear warm-up to BASE_LR, then cosine decay; a buggy branch at the end of warm-up."""
    if step < WARMUP:
        return BASE_LR * (step + 1) / WARMUP
    if step == WARMUP:
        return PEAK_MULT          # <-- FAULT LINE: meant BASE_LR (or BASE_LR * something); 10.0 is absolute
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return BASE_LR * 0.5 * (1 + math.cos(math.pi * progress))


def make_data():
    g = torch.Generator().manual_seed(17)
    w = torch.randn(D_IN, 1, generator=g)
    xs = torch.randn(STEPS, BATCH, D_IN, generator=g)
    ys = torch.tanh(xs @ w) + 0.1 * xs[..., :1] ** 2 + 0.05 * torch.randn(STEPS, BATCH, 1, generator=g)
    return xs, ys


def run(guarded, inspect=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=BASE_LR)
    xs, ys = make_data()
    losses = []
    ctx = amp_runtime.guard(policy="record", model=model) if guarded else nullcontext()
    with ctx as g:
        for step in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.zero_grad()
            loss = F.mse_loss(model(xs[step]), ys[step])
            loss.backward()
            if inspect is not None:
                inspect(step, model, loss, optimizer)
            optimizer.step()
            losses.append(loss.detach().clone())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "scales": [None] * len(losses), "weights": weights, "guard": g}


def plain():
    rows = []

    def inspect(step, model, loss, optimizer):
        grads = [p.grad for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in grads])).item()
        per_layer = {n.rsplit(".", 1)[0]: 0.0 for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            k = n.rsplit(".", 1)[0]
            per_layer[k] = max(per_layer[k], p.grad.abs().max().item())
        wmax = max(p.abs().max().item() for p in model.parameters())
        rows.append((step, optimizer.param_groups[0]["lr"], loss.item(), norm, per_layer, wmax))

    run(guarded=False, inspect=inspect)
    for step, lr, loss, norm, per_layer, wmax in rows:
        if step % 10 == 0 or WARMUP - 1 <= step <= WARMUP + 4 or step == STEPS - 1:
            pl = " ".join(f"{k}={v:.3g}" for k, v in per_layer.items())
            print(f"step {step:2d} lr={lr:<9.3g} loss={loss:<11.5g} grad norm={norm:<10.4g} max|w|={wmax:<8.3g} "
                  f"per-layer max|g|: {pl}")
    print("steps with grad norm > 100:", [r[0] for r in rows if r[3] > 100],
          "; > 1000:", [r[0] for r in rows if r[3] > 1000])
    print("all losses finite:", all(math.isfinite(r[2]) for r in rows),
          "; layers with all-zero grads at some step:",
          sorted({k for r in rows for k, v in r[4].items() if v == 0.0}))

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
