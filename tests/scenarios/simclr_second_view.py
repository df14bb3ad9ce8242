"""EXPECT: AMP101, AMP112
MAY: none
FAULT: SimCLR-style contrastive training: one model (encoder.0/encoder.2 + projector.0/projector.2)
called twice per step on two augmented views, NT-Xent computed in fp32 in an autocast(enabled=False)
island on upcast projections, fp16 autocast on the CPU, AdamW, GradScaler("cpu"), 60 steps, and no
`model=` passed to the guard (names must come from the modules seen running). The second view's
augmentation has a "unit conversion" jitter that multiplies one sample by 1e5 (line marked FAULT
LINE in augment_view2, meant 1e-5); it fires on about 4% of the batches. Measured with `--plain`:
at steps 30, 44 and 52 view 2 holds values up to 3.1e5 / 1.8e5 / 2.2e5 (beyond fp16's 65504),
the second forward's first Linear (encoder.0) outputs 128 non-finite values, z2 and the loss are
NaN, the gradients are NaN and GradScaler skips the step; view 1 is never non-finite. Besides,
steps 0 and 3 are skipped by the ordinary scale settling (finite forward, overflow only in the
scaled backward); the scale goes 65536 -> 2048 in 5 halvings spread over 52 steps, never 5 in a
row, never below 655 or 128. Per the pages: AMP112 (loss NaN at backward, steps 30, 44, 52),
AMP101 (the replay of step 30 names linear in encoder.0, the first op to make inf from finite
fp32 inputs (the autocast cast to fp16 happens inside it), in forward call 2 of 2, at the
`return self.projector(self.encoder(x))` line or the `z2 = model(v2)` line; steps 44/52 either
replayed or traced live). The settling skips at steps 0 and 3 must stay silent; no AMP103
(scaler), no AMP107/108/109 (see the scale history above).
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
D_IN, BATCH, TAU = 32, 32, 0.2
UNIT_JITTER_P = 0.04     # chance per batch that view 2 gets the "unit conversion" augmentation


class SimCLR(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D_IN, 128), nn.ReLU(), nn.Linear(128, 64))
        self.projector = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x):
        return self.projector(self.encoder(x))


def augment_view1(x, g):
    keep = (torch.rand(x.shape, generator=g) > 0.1).float()
    return x * keep + 0.1 * torch.randn(x.shape, generator=g)


def augment_view2(x, g):
    gain = torch.empty(x.shape[0], 1).uniform_(0.8, 1.25, generator=g)
    x = x * gain + 0.1 * torch.randn(x.shape, generator=g)
    if torch.rand((), generator=g) < UNIT_JITTER_P:
        i = int(torch.randint(0, x.shape[0], (), generator=g))
        x[i] = x[i] * 1e5      # <-- FAULT LINE: "unit conversion" jitter, meant 1e-5 (or a no-op)
    return x


def nt_xent(z1, z2):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.t() / TAU
    n = z1.shape[0]
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return F.cross_entropy(sim, target)


def make_data():
    g = torch.Generator().manual_seed(5)
    protos = torch.randn(16, D_IN, generator=g)
    return [protos[torch.randint(0, 16, (BATCH,), generator=g)] + 0.3 * torch.randn(BATCH, D_IN, generator=g)
            for _ in range(STEPS)]


def run(guarded, inspect=None):
    torch.manual_seed(0)
    model = SimCLR()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    data = make_data()
    aug_g = torch.Generator().manual_seed(99)
    losses, scales = [], []
    # no model= here on purpose: names must come from the modules seen running
    ctx = amp_runtime.guard(policy="record") if guarded else nullcontext()
    with ctx as g:
        for step, x in enumerate(data):
            v1, v2 = augment_view1(x, aug_g), augment_view2(x, aug_g)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                z1 = model(v1)
                z2 = model(v2)                                  # the second forward of the step
                with torch.autocast("cpu", enabled=False):
                    loss = nt_xent(z1.float(), z2.float())
            scaler.scale(loss).backward()
            if inspect is not None:
                inspect(step, model, scaler, loss, v1, v2, z1, z2)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach().float().clone())
            scales.append(scaler.get_scale())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "scales": scales, "weights": weights, "guard": g}


def plain():
    rows = []

    def inspect(step, model, scaler, loss, v1, v2, z1, z2):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            h2 = model.encoder[0](v2)
        rows.append((step, loss.item(), scaler.get_scale(), v1.abs().max().item(), v2.abs().max().item(),
                     torch.isfinite(z1).all().item(), torch.isfinite(z2).all().item(),
                     (~torch.isfinite(h2)).sum().item(),
                     any(not torch.isfinite(p.grad).all() for p in model.parameters())))

    r = run(guarded=False, inspect=inspect)
    for step, loss, s, m1, m2, f1, f2, nh2, badg in rows:
        if step % 10 == 0 or not (f1 and f2) or badg:
            print(f"step {step:2d} loss={loss:.4f} scale={s:g} max|view1|={m1:.3g} max|view2|={m2:.3g} "
                  f"z1 finite={f1} z2 finite={f2} non-finite in encoder.0(view2)={nh2} non-finite grads={badg}")
    print("steps with a non-finite second view output:", [x[0] for x in rows if not x[6]],
          "; first view ever non-finite:", any(not x[5] for x in rows))
    print("skipped steps (non-finite grads):", [x[0] for x in rows if x[8]], "; final scale", r["scales"][-1])
    print("fp16 max 65504: a view-2 input of", max(x[4] for x in rows), "does not fit fp16")

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
