"""EXPECT: AMP104
FAULT: gradient clipping that clips nothing. A bf16 denoising autoencoder uses a
summed reconstruction loss (`reduction="sum"`, as in the classic VAE/AE examples),
whose gradients are large by construction, and the loop "clips" them to 1.0. But
`params` is a generator expression that `AdamW(params, ...)` already consumed, so
`clip_grad_norm_(params, 1.0)` sees an empty iterable, returns 0 and leaves every
gradient as it is (torch only emits a UserWarning). The optimizer therefore applies
the raw gradients: measured without the guard, their total norm is 815 at step 0,
stays between 270 and 1440 for all 100 steps and exceeds 1000 from about step 70 on.
The AMP104 page judges the norm of the gradients the optimizer applies (after
clipping where the loop clips), so AMP104 must be reported (P1 from step 0, P0 once
it passes 1000). A guard that trusted the `clip_grad_norm_` call, or its returned
0, would miss it. bf16 without a scaler, all values finite, every layer's gradients
far from zero (smallest per-layer max |grad| ~1.9), so no other code. AdamW keeps the
updates bounded, so the loss still falls and the run looks healthy.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

IMG = 28 * 28
LATENT = 32
BATCH = 64
STEPS = 100
MAX_GRAD_NORM = 1.0


class DenoisingAutoencoder(nn.Module):
    def __init__(self, d_in=IMG, hidden=256, latent=LATENT):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(),
            nn.Linear(hidden, latent),
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent, hidden), nn.ReLU(),
            nn.Linear(hidden, d_in),
        )

    def forward(self, x):
        return self.decoder(self.encoder(x))


def synthetic_digits(seed=0):
    """Blurry stroke images in [0, 1]: a few random line segments per image."""
    gen = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij")
    while True:
        imgs = torch.zeros(BATCH, 28, 28)
        for _ in range(3):
            p0 = torch.rand(BATCH, 2, generator=gen) * 20 + 4
            d = torch.randn(BATCH, 2, generator=gen)
            d = d / d.norm(dim=1, keepdim=True)
            t = torch.linspace(0, 8, 12)
            px = p0[:, 0:1] + d[:, 0:1] * t
            py = p0[:, 1:2] + d[:, 1:2] * t
            dist = (xx.view(1, 1, 28, 28) - px.view(BATCH, -1, 1, 1)) ** 2 \
                + (yy.view(1, 1, 28, 28) - py.view(BATCH, -1, 1, 1)) ** 2
            imgs = torch.maximum(imgs, torch.exp(-dist / 2.0).amax(dim=1))
        clean = imgs.view(BATCH, IMG)
        noisy = (clean + 0.3 * torch.randn(BATCH, IMG, generator=gen)).clamp(0, 1)
        yield noisy, clean


model = DenoisingAutoencoder()
params = (p for p in model.parameters() if p.requires_grad)
optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-4)
data = synthetic_digits()

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        noisy, clean = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            recon = model(noisy)
            # summed reconstruction error, as in the classic VAE/AE examples
            loss = F.mse_loss(recon.float(), clean, reduction="sum")
        loss.backward()
        # BUG: `params` is the generator the optimizer already consumed: this clips nothing
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  recon loss/img {loss.item() / BATCH:.3f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
