"""Unconditional 64x64 GAN: non-saturating loss, lazy R1 on reals, generator EMA.

    python b45_gan_r1_ema.py --data /data/ffhq64 --steps 200000
"""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class Generator(nn.Module):
    def __init__(self, z_dim=256, ch=512):
        super().__init__()
        self.mapping = nn.Sequential(PixelNorm(), nn.Linear(z_dim, z_dim), nn.LeakyReLU(0.2), nn.Linear(z_dim, z_dim))
        self.fc = nn.Linear(z_dim, ch * 4 * 4)
        layers, c = [], ch
        for _ in range(4):  # 4 -> 64
            layers += [nn.Upsample(scale_factor=2), nn.Conv2d(c, c // 2, 3, padding=1), PixelNorm(), nn.LeakyReLU(0.2)]
            c //= 2
        self.body = nn.Sequential(*layers)
        self.to_rgb = nn.Conv2d(c, 3, 1)
        self.ch = ch

    def forward(self, z):
        w = self.mapping(z)
        x = self.fc(w).view(z.size(0), self.ch, 4, 4)
        return torch.tanh(self.to_rgb(self.body(x)))


class MinibatchStdDev(nn.Module):
    def __init__(self, group_size=4):
        super().__init__()
        self.group_size = group_size

    def forward(self, x):
        n, c, h, w = x.shape
        g = min(self.group_size, n)
        y = x.reshape(g, -1, c, h, w)
        y = y - y.mean(dim=0, keepdim=True)  # expect: AMP004
        y = (y.pow(2).mean(dim=0) + 1e-8).sqrt()
        y = y.mean(dim=(1, 2, 3)).reshape(-1, 1, 1, 1).repeat(g, 1, h, w)
        return torch.cat([x, y], dim=1)


class DBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv2(F.leaky_relu(self.conv1(x), 0.2))


class Discriminator(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.blocks = nn.Sequential(DBlock(3, ch), DBlock(ch, 2 * ch), DBlock(2 * ch, 4 * ch), DBlock(4 * ch, 8 * ch))
        self.mbstd = MinibatchStdDev()
        self.final_conv = nn.Conv2d(8 * ch + 1, 8 * ch, 3, padding=1)
        self.fc = nn.Linear(8 * ch * 4 * 4, 1)

    def forward(self, img):
        out = self.mbstd(self.blocks(img))
        out = F.leaky_relu(self.final_conv(out), 0.2)
        return self.fc(out.flatten(1))


class EMA:
    def __init__(self, model, decay=0.999):
        self.decay = decay
        self.shadow = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for p_ema, p in zip(self.shadow.parameters(), model.parameters()):
            p_ema.lerp_(p, 1.0 - self.decay)


def discriminator_loss(real_logits, fake_logits):
    logits = torch.cat([real_logits, fake_logits])
    targets = torch.cat([torch.ones_like(real_logits), torch.zeros_like(fake_logits)])
    return F.binary_cross_entropy(torch.sigmoid(logits), targets)  # expect: AMP003


def generator_loss(fake_logits):
    # non-saturating loss, -log D(G(z))
    return -torch.log(torch.sigmoid(fake_logits) + 1e-8).mean()  # expect: AMP011


def r1_penalty(real_logits, real_img):
    (grad,) = torch.autograd.grad(outputs=real_logits.sum(), inputs=real_img, create_graph=True)
    return grad.pow(2).flatten(1).sum(1).mean()


def regularize_discriminator(D, real, scaler, gamma, interval):
    real = real.detach().requires_grad_(True)
    penalty = r1_penalty(D(real), real)
    scaler.scale(penalty * (gamma / 2) * interval).backward()  # expect: AMP008
    return penalty.detach()


def prepare_batch(batch, device):
    images, _ = batch
    # uint8 -> [-1, 1]; half precision keeps the host->device copy small
    return images.to(device, non_blocking=True).half().div_(127.5).sub_(1.0)  # expect: AMP001


def build_optimizers(G, D, args):
    c = args.r1_interval / (args.r1_interval + 1)  # lazy-regularisation correction
    opt_g = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0.0, 0.99), eps=1e-8)
    opt_d = torch.optim.Adam(D.parameters(), lr=args.lr * c, betas=(0.0, 0.99 ** c), eps=1e-8)
    return opt_g, opt_d


def make_grad_scaler():
    try:
        return torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(init_scale=2.0 ** 10)


def save_state(path, step, G, D, ema, opt_g, opt_d, scaler):
    torch.save({"step": step, "G": G.state_dict(), "D": D.state_dict(), "G_ema": ema.shadow.state_dict(),
                "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "scaler": scaler.state_dict()}, path)


def export_generator(ema, path):
    g16 = copy.deepcopy(ema.shadow).half()
    torch.save(g16.state_dict(), path)


@torch.no_grad()
def sample_grid(ema, z, path):
    with torch.autocast("cuda", dtype=torch.float16):
        imgs = ema.shadow(z)
    torchvision.utils.save_image(imgs.float() * 0.5 + 0.5, path, nrow=8)


def train(args):
    device = torch.device("cuda")
    tf = torchvision.transforms.Compose([torchvision.transforms.Resize(64), torchvision.transforms.CenterCrop(64),
                                         torchvision.transforms.PILToTensor()])
    loader = DataLoader(torchvision.datasets.ImageFolder(args.data, tf), batch_size=args.batch_size,
                        shuffle=True, num_workers=8, drop_last=True, pin_memory=True)
    G, D = Generator(args.z_dim).to(device), Discriminator().to(device)
    ema = EMA(G)
    opt_g, opt_d = build_optimizers(G, D, args)
    scaler = make_grad_scaler()
    fixed_z = torch.randn(64, args.z_dim, device=device)
    step = 0
    if args.resume:
        state = torch.load(args.resume, map_location=device)
        for key, obj in (("G", G), ("D", D), ("G_ema", ema.shadow), ("opt_g", opt_g), ("opt_d", opt_d), ("scaler", scaler)):
            obj.load_state_dict(state[key])
        step = state["step"]

    while step < args.steps:
        for batch in loader:
            real = prepare_batch(batch, device)
            z = torch.randn(real.size(0), args.z_dim, device=device)

            # discriminator
            with torch.autocast("cuda", dtype=torch.float16):
                fake = G(z).detach()
                d_loss = discriminator_loss(D(real), D(fake))
            opt_d.zero_grad(set_to_none=True)
            scaler.scale(d_loss).backward()
            torch.nn.utils.clip_grad_norm_(D.parameters(), args.d_clip)  # expect: AMP005
            scaler.step(opt_d)
            scaler.update()

            if step % args.r1_interval == 0:
                opt_d.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    r1 = regularize_discriminator(D, real, scaler, args.r1_gamma, args.r1_interval)
                scaler.step(opt_d)
                scaler.update()

            # generator
            with torch.autocast("cuda", dtype=torch.float16):
                g_loss = generator_loss(D(G(z)))
            opt_g.zero_grad(set_to_none=True)
            scaler.scale(g_loss).backward()
            opt_g.step()  # expect: AMP006
            ema.update(G)

            if step % 1000 == 0:
                print(f"step {step} d {d_loss.item():.3f} g {g_loss.item():.3f} r1 {r1.item():.3f}")
                sample_grid(ema, fixed_z, os.path.join(args.out_dir, f"samples_{step:07d}.png"))
                save_state(os.path.join(args.out_dir, "state.pt"), step, G, D, ema, opt_g, opt_d, scaler)
            step += 1
    export_generator(ema, os.path.join(args.out_dir, "g_ema_fp16.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out-dir", dest="out_dir", default="runs/gan64")
    p.add_argument("--resume", default="")
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=64)
    p.add_argument("--z-dim", dest="z_dim", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--r1-gamma", dest="r1_gamma", type=float, default=10.0)
    p.add_argument("--r1-interval", dest="r1_interval", type=int, default=16)
    p.add_argument("--d-clip", dest="d_clip", type=float, default=10.0)
    train(p.parse_args())
