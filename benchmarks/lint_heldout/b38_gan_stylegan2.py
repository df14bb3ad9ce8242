"""Small StyleGAN2-style generator/discriminator with lazy R1 and path-length regularization.

Main losses every iteration, R1 on D every `--d-reg-every` steps, path-length
penalty on G every `--g-reg-every` steps (both scaled by the interval, as in the
paper). One GradScaler is shared by both optimizers; G_ema is kept for sampling.

    python b38_gan_stylegan2.py --data imgs.npy --res 32 --batch 32 --kimg 2000
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------- generator
class MappingNetwork(nn.Module):
    def __init__(self, z_dim, w_dim, num_ws, layers=4):
        super().__init__()
        self.num_ws = num_ws
        blocks = []
        for i in range(layers):
            blocks += [nn.Linear(z_dim if i == 0 else w_dim, w_dim), nn.LeakyReLU(0.2)]
        self.net = nn.Sequential(*blocks)

    def forward(self, z):
        z = z * (z.square().mean(dim=1, keepdim=True) + 1e-8).rsqrt()
        w = self.net(z)
        return w.unsqueeze(1).repeat(1, self.num_ws, 1)


class ModulatedConv(nn.Module):
    def __init__(self, cin, cout, w_dim, k=3, demodulate=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin, k, k))
        self.affine = nn.Linear(w_dim, cin)
        self.padding, self.demodulate = k // 2, demodulate

    def forward(self, x, w):
        b = x.shape[0]
        styles = self.affine(w)
        weight = self.weight[None] * styles[:, None, :, None, None]
        if self.demodulate:
            dcoefs = (weight.square().sum(dim=[2, 3, 4]) + 1e-8).rsqrt()
            weight = weight * dcoefs[:, :, None, None, None]
        x = x.reshape(1, -1, *x.shape[2:])
        weight = weight.reshape(-1, *weight.shape[2:])
        x = F.conv2d(x, weight.to(x.dtype), padding=self.padding, groups=b)
        return x.reshape(b, -1, *x.shape[2:])


class SynthesisBlock(nn.Module):
    def __init__(self, cin, cout, w_dim):
        super().__init__()
        self.conv0 = ModulatedConv(cin, cout, w_dim)
        self.conv1 = ModulatedConv(cout, cout, w_dim)
        self.to_rgb = ModulatedConv(cout, 3, w_dim, k=1, demodulate=False)
        self.noise_strength = nn.Parameter(torch.zeros([]))

    def forward(self, x, img, ws):
        x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        x = F.leaky_relu(self.conv0(x, ws[:, 0]), 0.2)
        noise = torch.randn(x.shape[0], 1, x.shape[2], x.shape[3], device=x.device, dtype=x.dtype)
        x = F.leaky_relu(self.conv1(x, ws[:, 1]) + noise * self.noise_strength, 0.2)
        rgb = self.to_rgb(x, ws[:, 2])
        img = rgb if img is None else F.interpolate(img, scale_factor=2, mode="bilinear") + rgb
        return x, img


class Generator(nn.Module):
    def __init__(self, z_dim=128, w_dim=128, res=32, ch=128):
        super().__init__()
        self.num_blocks = int(math.log2(res)) - 2
        self.mapping = MappingNetwork(z_dim, w_dim, num_ws=3 * self.num_blocks)
        self.const = nn.Parameter(torch.randn(1, ch, 4, 4))
        self.blocks = nn.ModuleList([SynthesisBlock(ch, ch, w_dim) for _ in range(self.num_blocks)])

    def forward(self, z, return_ws=False):
        ws = self.mapping(z)
        x, img = self.const.repeat(z.shape[0], 1, 1, 1), None
        for i, block in enumerate(self.blocks):
            x, img = block(x, img, ws[:, 3 * i: 3 * i + 3])
        return (img, ws) if return_ws else img


# ----------------------------------------------------------------------------- discriminator
class MinibatchStdDev(nn.Module):
    def __init__(self, group_size=4, num_channels=1):
        super().__init__()
        self.group_size, self.num_channels = group_size, num_channels

    def forward(self, x):
        n, c, h, w = x.shape
        g = min(self.group_size, n)
        f = self.num_channels
        y = x.reshape(g, -1, f, c // f, h, w)
        y = y - y.mean(dim=0)  # expect: AMP004
        y = (y * y).mean(dim=0)  # expect: AMP004
        y = (y + 1e-8).sqrt()  # expect: AMP011
        y = y.float().mean(dim=[2, 3, 4]).to(x.dtype)
        y = y.reshape(-1, f, 1, 1).repeat(g, 1, h, w)
        return torch.cat([x, y], dim=1)


class DBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv0 = nn.Conv2d(cin, cin, 3, padding=1)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1, stride=2, bias=False)

    def forward(self, x):
        y = F.leaky_relu(self.conv1(F.leaky_relu(self.conv0(x), 0.2)), 0.2)
        return (self.skip(x) + y) * (1 / math.sqrt(2))


class Discriminator(nn.Module):
    def __init__(self, res=32, ch=128):
        super().__init__()
        self.from_rgb = nn.Conv2d(3, ch, 1)
        self.blocks = nn.ModuleList([DBlock(ch, ch) for _ in range(int(math.log2(res)) - 2)])
        self.pre_mbstd = nn.Conv2d(ch, ch, 3, padding=1)
        self.mbstd = MinibatchStdDev()
        self.conv = nn.Conv2d(ch + 1, ch, 3, padding=1)
        self.fc = nn.Linear(ch * 16, ch)
        self.out = nn.Linear(ch, 1)

    def forward(self, img):
        x = F.leaky_relu(self.from_rgb(img), 0.2)
        for block in self.blocks:
            x = block(x)
        out = self.pre_mbstd(x)
        x = self.mbstd(out)
        x = F.leaky_relu(self.conv(x), 0.2)
        x = F.leaky_relu(self.fc(x.flatten(1)), 0.2)
        return self.out(x).float()


# ----------------------------------------------------------------------------- training
def infinite(loader):
    while True:
        yield from loader


@torch.no_grad()
def save_grid(G_ema, z, path):
    imgs = G_ema(z).clamp(-1, 1).add(1).mul(127.5).to(torch.uint8).cpu().numpy()
    np.save(path, imgs)


def train(G, D, G_ema, loader, args, device):
    mb_ratio_g = args.g_reg_every / (args.g_reg_every + 1)
    mb_ratio_d = args.d_reg_every / (args.d_reg_every + 1)
    g_opt = torch.optim.Adam(G.parameters(), lr=args.lr * mb_ratio_g,
                             betas=(0.0, 0.99 ** mb_ratio_g), eps=1e-8)
    d_opt = torch.optim.Adam(D.parameters(), lr=args.lr * mb_ratio_d,
                             betas=(0.0, 0.99 ** mb_ratio_d), eps=1e-8)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    pl_mean = torch.zeros([], device=device)
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        for mod, key in ((G, "G"), (D, "D"), (G_ema, "G_ema")):
            mod.load_state_dict(ckpt[key])
        g_opt.load_state_dict(ckpt["g_opt"])
        d_opt.load_state_dict(ckpt["d_opt"])
        scaler.load_state_dict(ckpt["scaler"])
        pl_mean, start = ckpt["pl_mean"].to(device), ckpt["step"]

    fixed_z = torch.randn(16, args.z_dim, device=device)
    ema_beta = 0.5 ** (args.batch / (args.ema_kimg * 1000))
    total_steps = args.kimg * 1000 // args.batch
    data = infinite(loader)
    for step in range(start, total_steps):
        real = next(data)[0]
        real = real.to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
        real = real / 127.5 - 1

        # ---------------- D main: logistic loss
        z = torch.randn(args.batch, args.z_dim, device=device)
        with torch.autocast("cuda", dtype=torch.float16):
            fake = G(z)
            d_fake = D(fake.detach())
            d_real = D(real)
            d_loss = F.softplus(d_fake).mean() + F.softplus(-d_real).mean()
        d_opt.zero_grad(set_to_none=True)
        scaler.scale(d_loss).backward()
        scaler.step(d_opt)
        scaler.update()

        # ---------------- D lazy R1
        if step % args.d_reg_every == 0:
            real_tmp = real.detach().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.float16):
                real_logits = D(real_tmp)
            r1_scaled = torch.autograd.grad(outputs=[scaler.scale(real_logits.sum())], inputs=[real_tmp],
                                            create_graph=True)[0]
            r1_grads = r1_scaled / scaler.get_scale()
            with torch.autocast("cuda", dtype=torch.float16):
                r1_penalty = r1_grads.square().sum(dim=[1, 2, 3])
                loss_r1 = r1_penalty.mean() * (args.r1_gamma / 2) * args.d_reg_every
                d_opt.zero_grad(set_to_none=True)
                scaler.scale(loss_r1).backward()  # expect: AMP008
            scaler.step(d_opt)
            scaler.update()

        # ---------------- G main: non-saturating loss
        z = torch.randn(args.batch, args.z_dim, device=device)
        with torch.autocast("cuda", dtype=torch.float16):
            g_loss = F.softplus(-D(G(z))).mean()
        g_opt.zero_grad(set_to_none=True)
        scaler.scale(g_loss).backward()
        g_opt.step()  # expect: AMP006
        scaler.update()

        # ---------------- G lazy path-length regularization
        if step % args.g_reg_every == 0:
            pl_batch = max(args.batch // 2, 1)
            z = torch.randn(pl_batch, args.z_dim, device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                fake, ws = G(z, return_ws=True)
                pl_noise = torch.randn_like(fake) / math.sqrt(fake.shape[2] * fake.shape[3])
                pl_out = (fake * pl_noise).sum()
            pl_scaled = torch.autograd.grad(outputs=[scaler.scale(pl_out)], inputs=[ws], create_graph=True)[0]
            pl_grads = pl_scaled / scaler.get_scale()
            pl_lengths = pl_grads.float().square().sum(2).mean(1).sqrt()
            pl_mean = pl_mean.lerp(pl_lengths.mean().detach(), args.pl_decay)
            pl_penalty = (pl_lengths - pl_mean).square()
            loss_pl = pl_penalty.mean() * args.pl_weight * args.g_reg_every
            g_opt.zero_grad(set_to_none=True)
            scaler.scale(loss_pl).backward()
            scaler.step(g_opt)
            scaler.update()

        # ---------------- EMA, logging, snapshots
        with torch.no_grad():
            for p_ema, p in zip(G_ema.parameters(), G.parameters()):
                p_ema.copy_(p.lerp(p_ema, ema_beta))
        if step % args.log_every == 0:
            print(f"step {step} d {d_loss.item():.3f} g {g_loss.item():.3f} pl_mean {pl_mean.item():.3f} "
                  f"scale {scaler.get_scale():.0f}")
        if step % args.snap_every == 0 or step == total_steps - 1:
            save_grid(G_ema, fixed_z, os.path.join(args.out, f"grid_{step:06d}.npy"))
            torch.save({"G": G.state_dict(), "D": D.state_dict(), "G_ema": G_ema.state_dict(),
                        "g_opt": g_opt.state_dict(), "d_opt": d_opt.state_dict(),
                        "scaler": scaler.state_dict(), "pl_mean": pl_mean, "step": step + 1},
                       os.path.join(args.out, "last.pt"))
            torch.save({k: v.half() for k, v in G_ema.state_dict().items()},
                       os.path.join(args.out, "G_ema_fp16.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=None)
    p.add_argument("--res", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--z-dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--kimg", type=int, default=2000)
    p.add_argument("--ema-kimg", type=float, default=10.0)
    p.add_argument("--r1-gamma", type=float, default=0.1)
    p.add_argument("--d-reg-every", type=int, default=16)
    p.add_argument("--g-reg-every", type=int, default=4)
    p.add_argument("--pl-weight", type=float, default=2.0)
    p.add_argument("--pl-decay", type=float, default=0.01)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--snap-every", type=int, default=2000)
    p.add_argument("--out", default="runs/sg2")
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    if args.data:
        images = torch.from_numpy(np.load(args.data))
    else:
        images = torch.randint(0, 256, (4096, 3, args.res, args.res), dtype=torch.uint8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=args.batch,
                                         shuffle=True, drop_last=True, num_workers=2, pin_memory=True)
    G = Generator(args.z_dim, args.z_dim, args.res)
    G.to(device)
    D = Discriminator(args.res)
    D.to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    train(G, D, G_ema, loader, args, device)


if __name__ == "__main__":
    main()
