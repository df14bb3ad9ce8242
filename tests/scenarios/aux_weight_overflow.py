"""EXPECT: AMP104, AMP107, AMP108
MAY: AMP106
FAULT: a sparse autoencoder (encoder 64-128-16, decoder 16-128-64) on raw features (std ~5.6),
fp16 autocast + GradScaler("cpu"), Adam, 70 steps. The latent-energy penalty
`aux_loss = z.float().pow(2).sum(dim=1).mean()` is weighted `AUX_WEIGHT = 1e4` (meant 1e-4) at
the line marked FAULT LINE. The forward and the loss stay finite (loss ~2.5e5 in fp32), but
the scaled backward through the fp16 encoder overflows: measured with `--plain`, |dL/dz| reaches
1565 at scale 1 and encoder.2.weight's fp16 gradient is inf even at scale 1, so GradScaler skips
steps 0..16 (17 in a row) and halves the scale 65536 -> 0.5, where it stays (growth_interval
2000). From step 17 on the steps go through with an unscaled total gradient norm of 1.1e6
(step 17) falling to 4.8e4 (step 69): the 1e4 weight makes every real gradient huge.
Per the pages: AMP108 (scale below init/100 after step 7's update, below 128 and falling after
step 9's), AMP107 (scale <= 1 and not rising from step 15's/16's update on: 1.0 then 0.5),
AMP104 (unscaled norm > 1000 on every step from 17). The layer to blame is encoder.2 (the last
encoder Linear, whose weight gradient overflows in every skipped step) and the line is the
`loss = recon_loss + AUX_WEIGHT * aux_loss` line; the loss-scale events sit at scaler.update().
No AMP101/AMP112 (forward and loss finite), no AMP103 (the scaler catches every inf), no AMP109
(its 100-step window, counted from the first step that went through, never fills). MAY AMP106:
at scale 0.5 some small fp16 gradients could flush to zero.
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

STEPS = 70
D_IN, D_H, D_Z, BATCH = 64, 128, 16, 64
AUX_WEIGHT = 1e4  # FAULT: meant 1e-4 (the latent-energy penalty of the paper), typed 1e4


class SparseAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_Z))
        self.decoder = nn.Sequential(nn.Linear(D_Z, D_H), nn.ReLU(), nn.Linear(D_H, D_IN))

    def forward(self, x):
        z = self.encoder(x)
        return self.decoder(z), z


def make_data():
    g = torch.Generator().manual_seed(7)
    basis = torch.randn(8, D_IN, generator=g)
    codes = torch.randn(STEPS, BATCH, 8, generator=g)
    return 2.0 * (codes @ basis) + 0.1 * torch.randn(STEPS, BATCH, D_IN, generator=g)   # raw features, std ~5.6


def run(guarded, inspect=None):
    torch.manual_seed(0)
    model = SparseAutoencoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    data = make_data()
    losses, scales = [], []
    ctx = amp_runtime.guard(policy="record", model=model) if guarded else nullcontext()
    with ctx as g:
        for step in range(STEPS):
            x = data[step]
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                recon, z = model(x)
                recon_loss = F.mse_loss(recon, x)
                aux_loss = z.float().pow(2).sum(dim=1).mean()    # latent energy, fp32
                loss = recon_loss + AUX_WEIGHT * aux_loss        # <-- FAULT LINE (weight 1e4)
            scaler.scale(loss).backward()
            if inspect is not None:
                inspect(step, model, scaler, loss, recon_loss, aux_loss)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach().float().clone())
            scales.append(scaler.get_scale())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "scales": scales, "weights": weights, "guard": g}


def plain():
    rows = []

    def inspect(step, model, scaler, loss, recon_loss, aux_loss):
        s = scaler.get_scale()
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
        finite = [p.grad.float() / s for p in model.parameters() if torch.isfinite(p.grad).all()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in finite])).item() if not bad else float("nan")
        rows.append((step, s, loss.item(), recon_loss.item(), aux_loss.item(), bad, norm))

    r = run(guarded=False, inspect=inspect)
    for step, s, loss, rl, al, bad, norm in rows:
        print(f"step {step:2d} scale={s:<10g} loss={loss:<12.6g} recon={rl:<9.4g} aux={al:<9.4g} "
              f"{'SKIP (inf grads in ' + ','.join(bad) + ')' if bad else f'unscaled grad norm={norm:.4g}'}")
    print("final scale", r["scales"][-1], "; skipped steps:", sum(1 for x in rows if x[5]),
          "; first step that went through:", next((x[0] for x in rows if not x[5]), None))
    # what the scaled backward of the aux term alone gives at scale 1 (the fp16 grads of z)
    torch.manual_seed(0)
    model = SparseAutoencoder()
    x = make_data()[0].requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.float16):
        recon, z = model(x)
        z.retain_grad()
        aux = AUX_WEIGHT * z.float().pow(2).sum(dim=1).mean()
    aux.backward()
    print("at scale 1: |dz| max", z.grad.abs().max().item(), "dtype", z.grad.dtype,
          "; encoder.2.weight grad finite:", torch.isfinite(model.encoder[2].weight.grad).all().item(),
          "; fp16 grads of encoder.2.weight max",
          model.encoder[2].weight.grad.abs().max().item())

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
