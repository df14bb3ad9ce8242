"""EXPECT: AMP104
FAULT: small MLP GAN on 8x8 "sprites" stored as 16-bit pixels (0..65535), bf16 autocast (no
GradScaler), two Adam optimizers (D step then G step; one training step per iteration). From
step 0 on, the real images go to the discriminator as raw 16-bit values (the `/ 32767.5 - 1`
normalisation is missing, line marked "# <- raw pixels"), while the generator's fakes are in
[-1, 1]. The discriminator's first layer `disc.net.0` sees inputs ~3e4x larger than designed;
the total unscaled gradient norm of the discriminator is ~6.4e3 at step 0 and 2e3-3.5e3 at
steps 1-6 (> 1000: AMP104 with severity P0), judged at the optimizer step (opt_d's step, line
`opt_d.step()`), steps 0.. onwards. bf16 keeps everything finite: no NaN/inf, no skipped step.
MAY: nothing else
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

Z, PIX = 16, 64


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(Z, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, PIX), nn.Tanh())

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(PIX, 128), nn.LeakyReLU(0.2), nn.Linear(128, 64),
                                 nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def make_sprites(n=2048):
    g = torch.Generator().manual_seed(21)
    yy, xx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    cy, cx = torch.rand(n, 1, 1, generator=g) * 5 + 1.5, torch.rand(n, 1, 1, generator=g) * 5 + 1.5
    r = torch.rand(n, 1, 1, generator=g) * 1.5 + 1.0
    blob = (((yy - cy) ** 2 + (xx - cx) ** 2) < r ** 2).float()
    return (blob * 65535).round().to(torch.int32).view(n, PIX)     # 16-bit pixel values


sprites = make_sprites()


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen, self.disc = Generator(), Discriminator()


gan = GAN()
opt_g = torch.optim.Adam(gan.gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(gan.disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
B = 64

with amp_runtime.guard(policy="record", model=gan) as g:
    for step in range(40):
        idx = torch.arange(step * B, (step + 1) * B) % sprites.size(0)
        real = sprites[idx].float()                                   # <- raw pixels
        z = torch.randn(B, Z)
        ones, zeros = torch.ones(B), torch.zeros(B)

        with torch.autocast("cpu", dtype=torch.bfloat16):
            fake = gan.gen(z)
            d_loss = (F.binary_cross_entropy_with_logits(gan.disc(real), ones)
                      + F.binary_cross_entropy_with_logits(gan.disc(fake.detach()), zeros))
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()

        with torch.autocast("cpu", dtype=torch.bfloat16):
            g_loss = F.binary_cross_entropy_with_logits(gan.disc(fake), ones)
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
