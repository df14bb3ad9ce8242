"""DCGAN / WGAN-GP training on CelebA-64 with mixed precision.

One GradScaler serves both optimizers: each network's backward is scaled, each
optimizer is stepped through the scaler, and the scaler is updated once per
generator/critic round.
"""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torchvision.utils as vutils
from torch.utils.data import DataLoader

from gan.data import celeba64
from gan.models import Discriminator, Generator, weights_init

AMP_DTYPE = torch.float16


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/celeba")
    p.add_argument("--loss", choices=["dcgan", "wgan-gp"], default="dcgan")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--nz", type=int, default=100)
    p.add_argument("--ngf", type=int, default=64)
    p.add_argument("--ndf", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--n-critic", type=int, default=5)
    p.add_argument("--gp-weight", type=float, default=10.0)
    p.add_argument("--clip-d", type=float, default=0.0)
    p.add_argument("--clip-g", type=float, default=10.0)
    p.add_argument("--ema-beta", type=float, default=0.999)
    p.add_argument("--out", default="runs/gan")
    return p.parse_args()


@torch.no_grad()
def ema_update(ema, model, beta):
    for p_ema, p in zip(ema.parameters(), model.parameters()):
        p_ema.copy_(p.detach().lerp(p_ema, beta))
    for b_ema, b in zip(ema.buffers(), model.buffers()):
        b_ema.copy_(b)


def gradient_penalty(netD, real, fake):
    """WGAN-GP penalty, computed in fp32 outside autocast (double backward)."""
    alpha = torch.rand(real.size(0), 1, 1, 1, device=real.device)
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    d_interp = netD(interp)
    (grads,) = torch.autograd.grad(d_interp.sum(), interp, create_graph=True)
    return ((grads.flatten(1).norm(2, dim=1) - 1) ** 2).mean()


def train_dcgan(netG, netD, G_ema, loader, opt_g, opt_d, scaler, args, device, epoch):
    adv_loss = nn.BCEWithLogitsLoss()
    for i, (real, _) in enumerate(loader):
        real = real.to(device, dtype=AMP_DTYPE, non_blocking=True)  # expect: AMP001
        b = real.size(0)
        z = torch.randn(b, args.nz, 1, 1, device=device)

        # (1) discriminator: maximise log D(x) + log(1 - D(G(z)))
        opt_d.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=AMP_DTYPE):
            fake = netG(z)
            d_real = netD(real)
            d_fake = netD(fake.detach())
            d_loss = adv_loss(d_real, torch.ones_like(d_real)) + adv_loss(d_fake, torch.zeros_like(d_fake))
        scaler.scale(d_loss).backward()
        if args.clip_d > 0:
            scaler.unscale_(opt_d)
            nn.utils.clip_grad_norm_(netD.parameters(), args.clip_d)
        scaler.step(opt_d)

        # (2) generator: maximise log D(G(z))
        opt_g.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=AMP_DTYPE):
            g_out = netD(fake)
        g_loss = adv_loss(g_out, torch.ones_like(g_out))  # expect: AMP002
        scaler.scale(g_loss).backward()
        opt_g.step()  # expect: AMP006
        scaler.update()
        ema_update(G_ema, netG, args.ema_beta)

        if i % 100 == 0:
            print(f"[{epoch}][{i}/{len(loader)}] D {d_loss.item():.4f} G {g_loss.item():.4f} "
                  f"scale {scaler.get_scale():.0f}")


def train_wgan_gp(netG, netD, G_ema, loader, opt_g, opt_d, scaler, args, device, epoch):
    for i, (real, _) in enumerate(loader):
        real = real.to(device, non_blocking=True)
        z = torch.randn(real.size(0), args.nz, 1, 1, device=device)

        # critic
        opt_d.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=AMP_DTYPE):
            fake = netG(z).detach()
            d_loss = netD(fake).mean() - netD(real).mean()
            scaler.scale(d_loss).backward()  # expect: AMP008
        gp = gradient_penalty(netD, real, fake.float())
        scaler.scale(args.gp_weight * gp).backward()
        scaler.step(opt_d)
        scaler.update()

        # generator, once every n_critic critic steps
        if i % args.n_critic == 0:
            opt_g.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=AMP_DTYPE):
                g_loss = -netD(netG(z)).mean()
            scaler.scale(g_loss).backward()
            torch.nn.utils.clip_grad_norm_(netG.parameters(), args.clip_g)  # expect: AMP005
            scaler.step(opt_g)
            scaler.update()
            ema_update(G_ema, netG, args.ema_beta)

        if i % 100 == 0:
            print(f"[{epoch}][{i}/{len(loader)}] critic {d_loss.item():.4f} gp {gp.item():.4f}")


@torch.no_grad()
def sample_grid(G_ema, noise, path):
    G_ema.eval()
    with torch.autocast("cuda", dtype=AMP_DTYPE):
        imgs = G_ema(noise)
    vutils.save_image(imgs.float(), path, normalize=True, nrow=8)


def save_checkpoint(netG, netD, G_ema, opt_g, opt_d, scaler, epoch, path):
    torch.save(
        {
            "G": netG.state_dict(),
            "D": netD.state_dict(),
            "G_ema_fp16": {k: v.half() for k, v in G_ema.state_dict().items()},
            "opt_g": opt_g.state_dict(),
            "opt_d": opt_d.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
        },
        path,
    )


def export_generator_onnx(G_ema, nz, path):
    model = copy.deepcopy(G_ema).half().eval()
    dummy = torch.randn(1, nz, 1, 1, device="cuda", dtype=torch.float16)
    torch.onnx.export(model, dummy, path, input_names=["z"], output_names=["image"], opset_version=17)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    loader = DataLoader(celeba64(args.data), batch_size=args.batch_size, shuffle=True,
                        num_workers=8, pin_memory=True, drop_last=True)

    netG = Generator(args.nz, args.ngf).to(device)
    netD = Discriminator(args.ndf, batchnorm=args.loss == "dcgan").to(device)
    netG.apply(weights_init)
    netD.apply(weights_init)
    G_ema = copy.deepcopy(netG).eval().requires_grad_(False)

    betas = (0.5, 0.999) if args.loss == "dcgan" else (0.0, 0.9)
    opt_g = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=betas)
    opt_d = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=betas)
    scaler = torch.amp.GradScaler("cuda")

    fixed_noise = torch.randn(64, args.nz, 1, 1, device=device, dtype=torch.float16)
    train_fn = train_dcgan if args.loss == "dcgan" else train_wgan_gp
    for epoch in range(args.epochs):
        netG.train()
        netD.train()
        train_fn(netG, netD, G_ema, loader, opt_g, opt_d, scaler, args, device, epoch)
        sample_grid(G_ema, fixed_noise, os.path.join(args.out, f"samples_{epoch:03d}.png"))
        save_checkpoint(netG, netD, G_ema, opt_g, opt_d, scaler, epoch,
                        os.path.join(args.out, "last.pt"))
    export_generator_onnx(G_ema, args.nz, os.path.join(args.out, "generator_fp16.onnx"))


if __name__ == "__main__":
    main()
