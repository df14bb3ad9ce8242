"""EXPECT: none

HEALTHY: the look-alike of s19_wgan_gp_scaled_penalty.py, written correctly: WGAN-GP,
N_CRITIC=5 (critic every iteration, generator every 5th, 300 critic and 60 generator steps),
one GradScaler per network, fp16 autocast for both networks; the gradient penalty is
computed in fp32 outside autocast (critic(x_hat) and torch.autograd.grad with
create_graph=True, no scaling needed there). The critic has no output bias (it cancels in
E[D(real)] - E[D(fake)] and would have an exactly-zero gradient). The generator step leaves
the critic's .grad holding the generator's scaled backward (norm about 1.1e5 at scale 65536):
opt_d zeroes it before its next backward and never applies it, so it is not a norm to judge.
Unguarded: no skipped step on either scaler (both stay at 65536), applied norms 0.2-27, no
NaN, fp16 peaks below 4, w_dist rises to 0.49, samples 1.21 from the nearest mode.
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
                d_real, d_fake = critic(real), critic(fake)
                wdist = d_real.mean() - d_fake.mean()
            # gradient penalty in fp32: the double backward stays out of fp16
            alpha = torch.rand(BATCH, 1)
            x_hat = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            grads = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)[0]
            gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
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
