"""EXPECT: AMP104 AMP108 AMP112
MAY: AMP101

FAULT: WGAN-GP with N_CRITIC=5 (critic every iteration, generator every 5th, one GradScaler
per network, fp16 autocast). The gradient penalty follows the PyTorch AMP notes halfway:
the critic's output is scaled before torch.autograd.grad (so the fp16 double backward does
not underflow) but the returned input gradients are never multiplied by 1/scale, so the
penalty is computed on gradients 65536 times too large.
- AMP112: at iteration 0 the scaled autograd.grad overflows fp16, the penalty and d_loss
  are NaN when d_loss's backward starts.
- AMP108: the critic's scaler skips its first 11 steps (iterations 0-10): 65536 -> 32,
  below 1/100 of the initial scale and below 128 while falling, then stays at 32.
- AMP104: the first critic step that goes through (iteration 11) applies an unscaled
  gradient norm of 2264 (> 1000), above 1000 until iteration 15 and above 100 until
  iteration 35.
The critic then learns a near-flat function (penalty forces |grad| to 1/32): w_dist stays
about 0.02 (0.49 in the healthy run), mean distance of samples to the nearest mode 1.48
(1.21 healthy).
MAY: AMP101 (the first non-finite values come out of torch.autograd.grad, i.e. a backward,
not a forward op; the guard replaces autograd.grad and could name it).
Must stay silent: AMP107 (the scale stops at 32), AMP109, AMP103 (both scalers catch).
"""
import json
import math
import time

import torch
import torch.nn as nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

Z_DIM, HIDDEN, BATCH = 16, 128, 256
ITERS, N_CRITIC, GP_LAMBDA = 300, 5, 10.0
LOG_EVERY = 25


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(Z_DIM, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, 2),
        )

    def forward(self, z):
        return self.net(z).float()


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, HIDDEN), nn.LeakyReLU(0.2),
            nn.Linear(HIDDEN, HIDDEN), nn.LeakyReLU(0.2),
            nn.Linear(HIDDEN, 1, bias=False),       # a bias cancels in E[D(real)] - E[D(fake)]
        )

    def forward(self, x):
        return self.net(x).float().squeeze(-1)       # scores in fp32 for the means


class EightGaussians:
    def __init__(self, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        angles = torch.arange(8) * (2 * math.pi / 8)
        self.centers = 2.0 * torch.stack([angles.cos(), angles.sin()], dim=1)

    def sample(self, n):
        idx = torch.randint(0, 8, (n,), generator=self.g)
        return self.centers[idx] + 0.05 * torch.randn(n, 2, generator=self.g)


class GanModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = Generator()
        self.critic = Critic()


def main():
    model = GanModel()
    gen, critic = model.generator, model.critic
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-4, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    scaler_g = torch.amp.GradScaler("cpu")
    scaler_d = torch.amp.GradScaler("cpu")
    data = EightGaussians()
    t0 = time.time()
    g_loss = torch.zeros(())
    with amp_runtime.guard(policy="record", model=model) as g:
        for it in range(ITERS):
            # ---- critic: every iteration ----
            real = data.sample(BATCH)
            z = torch.randn(BATCH, Z_DIM)
            opt_d.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(z).detach()
                alpha = torch.rand(BATCH, 1)
                x_hat = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
                d_real, d_fake, d_hat = critic(real), critic(fake), critic(x_hat)
            # gradient penalty: scale the output for autograd.grad (fp16 backward), as in the AMP notes
            grads = torch.autograd.grad(scaler_d.scale(d_hat.sum()), x_hat, create_graph=True)[0]
            with torch.autocast("cpu", dtype=torch.float16):
                gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
                wdist = d_real.mean() - d_fake.mean()
                d_loss = -wdist + GP_LAMBDA * gp
            scaler_d.scale(d_loss).backward()
            scaler_d.step(opt_d)
            scaler_d.update()

            # ---- generator: every N_CRITIC iterations ----
            if it % N_CRITIC == 0:
                opt_g.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    g_loss = -critic(gen(torch.randn(BATCH, Z_DIM))).mean()
                scaler_g.scale(g_loss).backward()
                scaler_g.step(opt_g)
                scaler_g.update()

            if it % LOG_EVERY == 0:
                print(f"iter {it:3d} d_loss {d_loss.item():8.4f} w_dist {wdist.item():7.4f} gp {gp.item():.4f} "
                      f"g_loss {g_loss.item():8.4f} scale_d {scaler_d.get_scale():.0f} "
                      f"scale_g {scaler_g.get_scale():.0f}")
    with torch.no_grad():
        sample = gen(torch.randn(2048, Z_DIM))
        dist = torch.cdist(sample, data.centers).min(dim=1).values.mean()
    print(f"done in {time.time() - t0:.1f}s; mean distance of samples to the nearest mode {dist:.3f}")
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
