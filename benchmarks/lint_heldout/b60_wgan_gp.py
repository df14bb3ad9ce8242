"""WGAN-GP on 64x64 images with an entropic-OT feature term for the generator.

Generator: ProGAN-style blocks with pixel normalisation after every convolution.
Critic: strided convolutions, LeakyReLU, a minibatch-stddev layer and no batch norm
(the gradient penalty needs per-sample gradients).  Besides the Wasserstein loss and
the gradient penalty (Gulrajani et al., 2017), the generator also minimises a Sinkhorn
distance between critic features of real and generated batches.
Mixed precision: fp16 autocast, one GradScaler shared by both players.
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class PixelNorm(nn.Module):
    def forward(self, x):
        ms = torch.mean(x * x, dim=1, keepdim=True)  # expect: AMP004
        return x / torch.sqrt(ms + 1e-8)  # expect: AMP011


class GBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm = PixelNorm()

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        x = F.leaky_relu(self.norm(self.conv1(x)), 0.2)
        return F.leaky_relu(self.norm(self.conv2(x)), 0.2)


class Generator(nn.Module):
    def __init__(self, latent_dim=128, base=256):
        super().__init__()
        self.base = base
        self.fc = nn.Linear(latent_dim, base * 4 * 4)
        self.norm = PixelNorm()
        self.blocks = nn.ModuleList([
            GBlock(base, base), GBlock(base, base // 2), GBlock(base // 2, base // 4),
            GBlock(base // 4, base // 8),
        ])
        self.to_rgb = nn.Conv2d(base // 8, 3, 1)

    def forward(self, z):
        z = z * torch.rsqrt(z.pow(2).mean(dim=1, keepdim=True) + 1e-8)
        x = self.fc(z).view(z.size(0), self.base, 4, 4)
        x = F.leaky_relu(self.norm(x), 0.2)
        for block in self.blocks:
            x = block(x)
        return torch.tanh(self.to_rgb(x))


class MinibatchStd(nn.Module):
    def __init__(self, group=4):
        super().__init__()
        self.group = group

    def forward(self, x):
        b, c, h, w = x.shape
        g = min(self.group, b)
        y = x.view(g, -1, c, h, w)
        mu = y.mean(dim=0, keepdim=True, dtype=torch.float32)
        var = (y - mu).pow(2).mean(dim=0)
        std = torch.sqrt(var + 1e-8).mean(dim=(1, 2, 3))
        std = std.to(x.dtype).view(-1, 1, 1, 1).repeat(g, 1, h, w)
        return torch.cat([x, std], dim=1)


class Critic(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, ch, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(ch, ch * 2, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(ch * 2, ch * 4, 4, 2, 1), nn.LeakyReLU(0.2),
        )
        self.mbstd = MinibatchStd()
        self.conv_final = nn.Conv2d(ch * 4 + 1, ch * 4, 3, padding=1)
        self.fc = nn.Linear(ch * 4 * 8 * 8, 1)

    def embed(self, img):
        return F.adaptive_avg_pool2d(self.features(img), 1).flatten(1)

    def forward(self, img):
        h = self.mbstd(self.features(img))
        h = F.leaky_relu(self.conv_final(h), 0.2)
        return self.fc(h.flatten(1)).float().squeeze(1)


def sinkhorn_distance(x, y, reg=0.1, n_iters=30):
    """Entropic OT between two point clouds with uniform weights (Cuturi, 2013)."""
    cost = torch.cdist(x, y).pow(2)
    cost = cost / cost.detach().max()
    kernel = torch.exp(-cost / reg)
    a = torch.full((x.size(0),), 1.0 / x.size(0), device=x.device)
    b = torch.full((y.size(0),), 1.0 / y.size(0), device=y.device)
    u = torch.ones_like(a)
    v = torch.ones_like(b)
    for _ in range(n_iters):
        u = a / (kernel @ v + 1e-8)  # expect: AMP011
        v = b / (kernel.t() @ u + 1e-8)  # expect: AMP011
    plan = u[:, None] * kernel * v[None, :]
    return (plan * cost).sum()


def gradient_penalty(critic, real, fake, scaler):
    alpha = torch.rand(real.size(0), 1, 1, 1, device=real.device)
    interp = (alpha * real + (1.0 - alpha) * fake).requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.float16):
        out = critic(interp)
    scaled = torch.autograd.grad(outputs=scaler.scale(out.sum()), inputs=interp, create_graph=True)[0]
    grads = scaled / scaler.get_scale()
    with torch.autocast("cuda", dtype=torch.float16):
        grad_norm = torch.sqrt(grads.flatten(1).pow(2).sum(dim=1) + 1e-12)
        return (grad_norm - 1.0).pow(2).mean()


def export_generator(generator, path, latent_dim):
    g = copy.deepcopy(generator).half().eval()
    example = torch.randn(1, latent_dim, device=next(g.parameters()).device).half()
    with torch.no_grad():
        traced = torch.jit.trace(g, example)
    traced.save(path)


def image_batches(n_batches, batch_size, device):
    for _ in range(n_batches):
        base = torch.rand(batch_size, 3, 1, 1, device=device)
        yy = torch.linspace(-1, 1, 64, device=device).view(1, 1, 64, 1)
        xx = torch.linspace(-1, 1, 64, device=device).view(1, 1, 1, 64)
        yield torch.tanh(3.0 * (base - 0.5) + torch.sin(4.0 * math.pi * base * (xx + yy)))


def train(args):
    device = torch.device("cuda")
    G = Generator(args.latent_dim).to(device)
    D = Critic().to(device)
    opt_g = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(D.parameters(), lr=args.lr, betas=(0.0, 0.9))
    scaler = torch.amp.GradScaler("cuda")
    fixed_z = torch.randn(64, args.latent_dim, device=device)

    step = 0
    for real in image_batches(args.iters, args.batch_size, device):
        for _ in range(args.n_critic):
            z = torch.randn(real.size(0), args.latent_dim, device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                fake = G(z).detach()
                d_real = D(real)
                d_fake = D(fake)
                d_wass = d_fake.mean() - d_real.mean()
                drift = args.drift * d_real.pow(2).mean()
            gp = gradient_penalty(D, real, fake.float(), scaler)
            d_loss = d_wass + drift + args.lambda_gp * gp

            opt_d.zero_grad(set_to_none=True)
            scaler.scale(d_loss).backward()
            scaler.step(opt_d)
            scaler.update()

        z = torch.randn(real.size(0), args.latent_dim, device=device)
        with torch.autocast("cuda", dtype=torch.float16):
            fake = G(z)
            g_adv = -D(fake).mean()
            ot = sinkhorn_distance(D.embed(real), D.embed(fake))
            g_loss = g_adv + args.ot_weight * ot

        opt_g.zero_grad(set_to_none=True)
        scaler.scale(g_loss).backward()
        opt_g.step()  # expect: AMP006

        step += 1
        if step % args.log_every == 0:
            print(f"step {step}: W {-d_wass.item():.4f} gp {gp.item():.4f} "
                  f"g_adv {g_adv.item():.4f} ot {ot.item():.4f} scale {scaler.get_scale():.0f}")
        if step % args.sample_every == 0:
            with torch.no_grad():
                grid = G(fixed_z).float().clamp(-1, 1)
            torch.save(grid.cpu(), f"samples_{step:06d}.pt")
    return G


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--latent-dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--n-critic", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lambda-gp", type=float, default=10.0)
    p.add_argument("--drift", type=float, default=1e-3)
    p.add_argument("--ot-weight", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--sample-every", type=int, default=1000)
    p.add_argument("--export", default="")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    G = train(args)
    if args.export:
        export_generator(G, args.export, args.latent_dim)


if __name__ == "__main__":
    main()
