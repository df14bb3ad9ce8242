"""EXPECT: AMP105,AMP106
MAY: none
FAULT: a surrogate model predicts a strain field (8 gauges) from 24 load features and trains in
CPU autocast float16 with a default GradScaler (init_scale 65536) and Adam.  The network works
in normalised units, but the training step converts its output to physical strain before the
loss, `pred = model(x) * STRAIN_STD` with STRAIN_STD = 3e-5 ("so the logged loss is in
physical units"), against targets stored in physical strain.  The MSE is therefore ~1e-9
(a tiny loss), and the gradient that the fp16 backward carries into the network is
~STRAIN_STD**2 smaller than usual: even multiplied by 65536 most weight gradients are fp16
subnormals, and ~3-21% of each weight matrix's nonzero gradients flush to exactly zero
(measured below with plain torch against an fp32 backward of the same weights at steps 0,
31 and 32, before any guarded run).  No step overflows, the scale stays 65536.
Why these codes (quotes from docs/rules):
- AMP106 "for each weight matrix or kernel, estimates the fraction of its nonzero gradients
  that flush to zero in fp16 at the current loss scale, and reports a layer where it exceeds
  1%" ("Every 32nd training step"; 40 steps cover it); its estimate uses "the scaled values
  that rounded to fp16's smallest subnormal (2^-24)" -- hundreds per layer here (counted).
- AMP105 "reports a total gradient norm below 1e-6" -> the unscaled total norm is ~1e-10 at
  every step (printed below); its page names this cause: "in fp16 gradients that underflow
  to zero because the loss scale is too low (AMP106)".
Must NOT fire: AMP107/AMP108/AMP109 (no skipped step, the scale never moves), AMP104,
AMP101/AMP103/AMP112 (everything finite), AMP011 (Adam over fp32 master weights), AMP002
(the loss is inside the autocast block), AMP010.
"""
import copy
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS = 40
STRAIN_STD = 3e-5


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


gen = torch.Generator().manual_seed(1)
LOADS = torch.randn(STEPS, 64, 24, generator=gen)
MIX = torch.randn(24, 8, generator=gen) / 24 ** 0.5
STRAIN = (torch.tanh(LOADS @ MIX) + 0.1 * torch.randn(STEPS, 64, 8, generator=gen)) * STRAIN_STD


def flush_stats(model, x, y, scale):
    """Plain torch: fp16-autocast gradients vs an fp32 backward of the same weights."""
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x) * STRAIN_STD, y).mul(scale).backward()
    out = {}
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if p.dim() < 2:
            continue
        scaled = p.grad  # still scaled (read before scaler.step unscales): what the fp16 backward held
        nonzero = r.grad != 0
        flushed = nonzero & (scaled == 0)
        out[name] = (round(flushed.sum().item() / nonzero.sum().item(), 3), int((scaled.abs() == 2 ** -24).sum()))
    return out


def train(model, log=None):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(STEPS):
        x, y = LOADS[step], STRAIN[step]
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x) * STRAIN_STD  # back to physical units for the loss
            loss = F.mse_loss(pred, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        if log is not None:
            norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item() / before
            stats = flush_stats(model, x, y, before) if step in (0, 31, 32) else None
        scaler.step(optimizer)
        scaler.update()
        if log is not None:
            log.append((step, loss.item(), before, scaler.get_scale(), norm, stats))
        losses.append(loss.detach().clone())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def precheck():
    log = []
    train(build(), log)
    for step, loss, before, after, norm, stats in log:
        if stats or step in (1, 39):
            print(f"PRECHECK step {step} loss {loss:.3g} scale {before}->{after} unscaled grad norm {norm:.3g} "
                  f"(weight: flushed fraction, count at 2^-24) {stats}")
    assert all(after == before == 65536.0 for _, _, before, after, _, _ in log)
    assert max(n for *_, n, _ in log) < 1e-6
    for *_, stats in log:
        if stats:
            assert all(frac > 0.01 for frac, _ in stats.values()), stats


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    precheck()
    ref_losses, ref_weights = train(build())
    model = build()
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
