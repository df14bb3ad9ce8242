"""EXPECT: AMP006
MAY: AMP104
FAULT: a small GAN on a 2-D-ish mixture (32-dim samples), fp16 autocast, ONE GradScaler
shared by the discriminator and the generator (the recommended set-up). The
discriminator step is done right: `scaler.scale(loss_d).backward(); scaler.step(opt_d)`.
The generator step, at line 66, marked `# <-- FAULT`, runs `scaler.scale(loss_g)
.backward()` and then a plain `opt_g.step()` on every iteration from step 0, so Adam
steps on gradients still multiplied by 65536 and no inf/NaN check protects G; then one
`scaler.update()` per iteration. Checked with plain torch (no guard): G's scaled gradient
norm is ~5e3-1.4e4 (unscaled ~0.1), nothing becomes non-finite in 60 iterations, and the
scaler never skips; Adam's scale invariance hides the bug in the losses.
Why these codes (from the pages): AMP006 runtime = "an optimizer steps on scaled grads"
(`opt_g.step()`, every iteration). MAY AMP104: its page says the total norm is taken
"unscaled (divided by the GradScaler's scale where one is used ...)"; whether the
generator's plain step is divided by the scale (norm ~0.1) or judged as stepped (norm
~1e4 > 1000) is not said. Not AMP103 (all gradients finite), not AMP108/AMP109 (no skip).
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

ZDIM, XDIM = 16, 32

G = nn.Sequential(nn.Linear(ZDIM, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                  nn.Linear(128, XDIM))
D = nn.Sequential(nn.Linear(XDIM, 128), nn.LeakyReLU(0.2), nn.Linear(128, 64), nn.LeakyReLU(0.2),
                  nn.Linear(64, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
scaler = torch.amp.GradScaler("cpu")
modes = torch.randn(4, XDIM) * 2


def real_batch(n=64):
    return modes[torch.randint(0, 4, (n,))] + 0.3 * torch.randn(n, XDIM)


with amp_runtime.guard(policy="record") as g:
    for step in range(60):
        real = real_batch()
        z = torch.randn(64, ZDIM)

        # discriminator
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            d_real, d_fake = D(real), D(fake.detach())
            loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                      + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        opt_d.zero_grad(set_to_none=True)
        scaler.scale(loss_d).backward()
        scaler.step(opt_d)

        # generator
        with torch.autocast("cpu", dtype=torch.float16):
            d_gen = D(fake)
            loss_g = F.binary_cross_entropy_with_logits(d_gen, torch.ones_like(d_gen))
        opt_g.zero_grad(set_to_none=True)
        scaler.scale(loss_g).backward()
        opt_g.step()  # <-- FAULT: should be scaler.step(opt_g)
        scaler.update()

        if step % 20 == 0:
            print(f"step {step} loss_d {loss_d.item():.4f} loss_g {loss_g.item():.4f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
