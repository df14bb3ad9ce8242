"""EXPECT: AMP002
MAY: none
FAULT: a small GAN (generator and discriminator MLPs, one Adam and one GradScaler per
network, CPU autocast float16) computes the DISCRIMINATOR's loss after the autocast block:
`d_loss = criterion(d_real, ones) + criterion(d_fake, zeros)` with `criterion =
nn.BCEWithLogitsLoss()` on the fp16 logits `d_real`, `d_fake` produced inside the block.  The
generator's loss is computed inside the block (correct; CPU autocast runs BCE-with-logits in
fp32 there).  Outside autocast the discriminator's loss runs in fp16 and is an fp16 tensor; its
backward receives the loss scale 65536 as an fp16 gradient, which overflows to inf, so the
discriminator's scaler skips iteration 0 and settles at 32768; no other step is skipped
(checked with plain torch below).  No NaN appears in any forward.
Why this code (quotes from docs/rules/AMP002.md): "At run time the guard reports a loss
function that runs with autocast off on fp16/bf16 inputs produced under autocast" -> the
`d_loss = ...` line, from step 0 (a code-pattern rule: "see every torch call only on watched
steps: the first `Thresholds.watch_steps` (default 8), then one step in ... 16").
Steps (index.md): "Several optimizers or several GradScalers (a GAN with one per network)
count one step per iteration, ending after the last of them (learned in the first
iteration, which may count twice)".
Must NOT fire: AMP006 (each optimizer steps through its own scaler, each scaler is updated;
"An optimizer the scaler never sees counts where a scaled backward wrote its gradients" does
not apply: both are seen), AMP005 (no clipping), AMP010 (fp16 with scalers), AMP008
(backward after the block), AMP103 (the one overflow is caught by the scaler: "Steps that a
GradScaler skips ... are not AMP103"), AMP108 (one settling decrease: "the skips before the
first one are the scale settling"), AMP109, AMP112/AMP101 (all losses and outputs finite),
AMP003 (BCE *with logits*), AMP004 (no explicit reductions).
"""
import json
import math

import torch
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS = 30
Z = 8
B = 64

gen = torch.Generator().manual_seed(1)
REAL = torch.randn(STEPS, B, 2, generator=gen) * 0.3 + torch.tensor([2.0, -1.0])
NOISE = torch.randn(STEPS, B, Z, generator=gen)


def build():
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(Z, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 2))
    discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    return generator, discriminator


def train(generator, discriminator, log=None):
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    scaler_g = torch.amp.GradScaler("cpu")
    scaler_d = torch.amp.GradScaler("cpu")
    criterion = nn.BCEWithLogitsLoss()
    losses = []
    for step in range(STEPS):
        real, z = REAL[step], NOISE[step]

        # ---- discriminator
        with torch.autocast("cpu", dtype=torch.float16):
            fake = generator(z)
            d_real = discriminator(real)
            d_fake = discriminator(fake.detach())
        d_loss = criterion(d_real, torch.ones_like(d_real)) + criterion(d_fake, torch.zeros_like(d_fake))
        opt_d.zero_grad(set_to_none=True)
        scaler_d.scale(d_loss).backward()
        d_before = scaler_d.get_scale()
        scaler_d.step(opt_d)
        scaler_d.update()

        # ---- generator
        with torch.autocast("cpu", dtype=torch.float16):
            g_logits = discriminator(fake)
            g_loss = criterion(g_logits, torch.ones_like(g_logits))
        opt_g.zero_grad(set_to_none=True)
        scaler_g.scale(g_loss).backward()
        g_before = scaler_g.get_scale()
        scaler_g.step(opt_g)
        scaler_g.update()

        losses += [d_loss.detach().clone(), g_loss.detach().clone()]
        if log is not None:
            log.append((step, d_loss.dtype, d_loss.item(), g_loss.dtype, g_loss.item(),
                        d_before, scaler_d.get_scale(), g_before, scaler_g.get_scale()))
    weights = {f"G.{k}": v.detach().clone() for k, v in generator.state_dict().items()}
    weights.update({f"D.{k}": v.detach().clone() for k, v in discriminator.state_dict().items()})
    return losses, weights


def precheck():
    log = []
    train(*build(), log=log)
    for row in log[:3] + log[-1:]:
        print("PRECHECK step {} d_loss {} {:.4f} g_loss {} {:.4f} D scale {} -> {} G scale {} -> {}".format(*row))
    d_skips = [r[0] for r in log if r[6] < r[5]]
    g_skips = [r[0] for r in log if r[8] < r[7]]
    finite = all(math.isfinite(r[2]) and math.isfinite(r[4]) for r in log)
    print("PRECHECK D skipped", d_skips, "G skipped", g_skips, "all losses finite", finite)
    assert log[0][1] == torch.float16 and log[0][3] == torch.float32
    assert d_skips == [0] and g_skips == [] and finite


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    precheck()
    ref_losses, ref_weights = train(*build())
    generator, discriminator = build()
    with amp_runtime.guard(policy="record") as g:
        losses, weights = train(generator, discriminator)
    print("LOSSES_MATCH", len(losses) == len(ref_losses) and all(same(a, b) for a, b in zip(losses, ref_losses)))
    print("WEIGHTS_MATCH", weights.keys() == ref_weights.keys() and all(same(weights[k], ref_weights[k]) for k in weights))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} :: {e.message}")
    print("COUNTS", json.dumps(g.report.to_json().get("counts", {}), sort_keys=True))
    print("EVENTS", json.dumps(sorted(set(g.report.codes()))))


if __name__ == "__main__":
    main()
