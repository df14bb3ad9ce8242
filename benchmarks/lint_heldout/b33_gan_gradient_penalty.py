"""Progressive-GAN style generator/discriminator with gradient penalty, fp16 AMP.

The gradient penalty follows the "gradient penalty" recipe of the AMP examples:
the critic output is scaled before torch.autograd.grad and the gradients are
unscaled by hand before the penalty is formed.
"""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data import ImageFolderDataset  # local


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class MinibatchStdDev(nn.Module):
    def __init__(self, group_size=4):
        super().__init__()
        self.group_size = group_size

    def forward(self, x):
        B, C, H, W = x.shape
        G = min(self.group_size, B)
        y = x.reshape(G, -1, C, H, W)
        std = torch.sqrt(y.var(dim=0, unbiased=False) + 1e-8)  # expect: AMP004, AMP011
        std = std.mean(dim=(1, 2, 3))  # expect: AMP004
        std = std.reshape(-1, 1, 1, 1).repeat(G, 1, H, W)
        return torch.cat([x, std], dim=1)


class GBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm = PixelNorm()

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        x = self.norm(F.leaky_relu(self.conv1(x), 0.2))
        return self.norm(F.leaky_relu(self.conv2(x), 0.2))


class Generator(nn.Module):
    def __init__(self, z_dim=512, ch=512, img_ch=3):
        super().__init__()
        self.ch = ch
        self.fc = nn.Linear(z_dim, ch * 4 * 4)
        self.norm = PixelNorm()
        chans = [ch, ch, ch // 2, ch // 4, ch // 8]
        self.blocks = nn.ModuleList([GBlock(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.to_rgb = nn.Conv2d(chans[-1], img_ch, 1)

    def forward(self, z):
        x = F.leaky_relu(self.fc(z), 0.2).view(z.size(0), self.ch, 4, 4)
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return torch.tanh(self.to_rgb(x))


class DBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.down = nn.Conv2d(cout, cout, 3, stride=2, padding=1)

    def forward(self, x):
        x = F.leaky_relu(self.conv(x), 0.2)
        return F.leaky_relu(self.down(x), 0.2)


class Discriminator(nn.Module):
    def __init__(self, ch=512, img_ch=3, mbstd_group=4):
        super().__init__()
        chans = [ch // 8, ch // 4, ch // 2, ch, ch]
        self.from_rgb = nn.Conv2d(img_ch, chans[0], 1)
        self.blocks = nn.ModuleList([DBlock(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.mbstd = MinibatchStdDev(mbstd_group)
        self.conv_out = nn.Conv2d(ch + 1, ch, 3, padding=1)
        self.fc = nn.Linear(ch * 4 * 4, 1)

    def forward(self, img):
        h = F.leaky_relu(self.from_rgb(img), 0.2)
        for block in self.blocks:
            h = block(h)
        h = self.mbstd(h)
        h = F.leaky_relu(self.conv_out(h), 0.2)
        return self.fc(h.flatten(1)).squeeze(1)


def gradient_penalty(D, real, fake, scaler, amp):
    alpha = torch.rand(real.size(0), 1, 1, 1, device=real.device)
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        d_interp = D(interp)
    d_sum = d_interp.sum()  # expect: AMP004
    scaled_grads = torch.autograd.grad(outputs=scaler.scale(d_sum), inputs=interp, create_graph=True)[0]
    grads = scaled_grads / scaler.get_scale()
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        penalty = ((grads.flatten(1).norm(2, dim=1) - 1.0) ** 2).mean()
    return penalty


def d_step(G, D, real, opt_d, scaler, args):
    z = torch.randn(real.size(0), args.z_dim, device=real.device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
        fake = G(z).float()
    with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
        d_real = D(real)
        d_fake = D(fake)
        if args.loss == "wgan":
            loss_real = -d_real.mean()  # expect: AMP004
            loss_fake = d_fake.mean()  # expect: AMP004
        else:
            loss_real = F.softplus(-d_real).mean()
            loss_fake = F.softplus(d_fake).mean()
        drift = args.drift * d_real.pow(2).mean()
    gp = gradient_penalty(D, real, fake, scaler, args.amp)
    d_loss = loss_real + loss_fake + drift + args.gp_weight * gp

    opt_d.zero_grad(set_to_none=True)
    scaler.scale(d_loss).backward()
    scaler.unscale_(opt_d)
    torch.nn.utils.clip_grad_norm_(D.parameters(), args.clip)
    scaler.step(opt_d)
    scaler.update()
    return {"d_loss": d_loss.item(), "gp": gp.item()}


def g_step(G, D, opt_g, scaler, args, batch_size, device):
    z = torch.randn(batch_size, args.z_dim, device=device)
    with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
        d_gen = D(G(z))
        if args.loss == "wgan":
            g_loss = -d_gen.mean()  # expect: AMP004
        else:
            g_loss = F.softplus(-d_gen).mean()

    opt_g.zero_grad(set_to_none=True)
    scaler.scale(g_loss).backward()
    torch.nn.utils.clip_grad_norm_(G.parameters(), args.clip)  # expect: AMP005
    scaler.step(opt_g)
    scaler.update()
    return {"g_loss": g_loss.item()}


@torch.no_grad()
def accumulate(g_ema, G, decay=0.999):
    for p_ema, p in zip(g_ema.parameters(), G.parameters()):
        p_ema.lerp_(p, 1.0 - decay)
    for b_ema, b in zip(g_ema.buffers(), G.buffers()):
        b_ema.copy_(b)


@torch.no_grad()
def sample_grid(g_ema, z, amp):
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        imgs = g_ema(z)
    imgs = (imgs.float().clamp(-1, 1) + 1) / 2
    return imgs.mean(dim=0), imgs


def save_checkpoint(G, D, g_ema, step, path):
    torch.save(
        {
            "G": G.state_dict(),
            "D": D.state_dict(),
            "g_ema_fp16": copy.deepcopy(g_ema).half().state_dict(),
            "step": step,
        },
        path,
    )


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--z-dim", dest="z_dim", type=int, default=512)
    p.add_argument("--ch", type=int, default=512)
    p.add_argument("--loss", choices=["wgan", "logistic"], default="wgan")
    p.add_argument("--gp-weight", dest="gp_weight", type=float, default=10.0)
    p.add_argument("--drift", type=float, default=1e-3)
    p.add_argument("--n-critic", dest="n_critic", type=int, default=2)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=64)
    p.add_argument("--iters", type=int, default=200_000)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out", default="runs/pggan")
    return p.parse_args()


def main():
    args = parse_args()
    device = torch.device("cuda")
    loader = DataLoader(ImageFolderDataset(args.data, resolution=64), batch_size=args.batch_size,
                        shuffle=True, num_workers=8, drop_last=True)
    G = Generator(args.z_dim, args.ch).to(device)
    D = Discriminator(args.ch).to(device)
    g_ema = copy.deepcopy(G).eval().requires_grad_(False)
    opt_g = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0.0, 0.99), eps=1e-8)
    opt_d = torch.optim.Adam(D.parameters(), lr=args.lr, betas=(0.0, 0.99), eps=1e-8)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    fixed_z = torch.randn(64, args.z_dim, device=device)
    os.makedirs(args.out, exist_ok=True)

    step = 0
    while step < args.iters:
        for real in loader:
            real = real.to(device, non_blocking=True)
            logs = d_step(G, D, real, opt_d, scaler, args)
            if step % args.n_critic == 0:
                logs.update(g_step(G, D, opt_g, scaler, args, real.size(0), device))
                accumulate(g_ema, G)
            if step % 1000 == 0:
                mean_img, _ = sample_grid(g_ema, fixed_z, args.amp)
                print(step, {k: round(v, 4) for k, v in logs.items()}, f"mean px {mean_img.mean().item():.3f}")
                save_checkpoint(G, D, g_ema, step, os.path.join(args.out, f"ckpt_{step:07d}.pt"))
            step += 1
            if step >= args.iters:
                break


if __name__ == "__main__":
    main()
