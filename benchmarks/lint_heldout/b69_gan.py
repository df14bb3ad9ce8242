"""DCGAN and a hinge/non-saturating variant with R1, both with mixed precision.

Based on the pytorch/examples DCGAN; ``--loss ns`` switches to the logit-based
discriminator used for the larger resolutions.
"""
import argparse
import copy
import os
import random

import torch
import torch.nn.functional as F
import torchvision.utils as vutils
from torch import nn, optim

from gan_data import build_dataset

REAL_LABEL = 1.0
FAKE_LABEL = 0.0


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, nz=100, ngf=64, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf=64, nc=3, logits=False):
        super().__init__()
        layers = [
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
        ]
        if not logits:
            layers.append(nn.Sigmoid())
        self.main = nn.Sequential(*layers)

    def forward(self, x):
        return self.main(x)


class AttrDiscriminator(nn.Module):
    """Logit discriminator with an auxiliary attribute head (AC-GAN style)."""

    def __init__(self, ndf=64, nc=3, n_attrs=40):
        super().__init__()
        self.body = Discriminator(ndf, nc, logits=True).main[:-1]
        self.adv = nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False)
        self.attr = nn.Conv2d(ndf * 8, n_attrs, 4, 1, 0, bias=False)

    def forward(self, x):
        h = self.body(x)
        return self.adv(h).flatten(1).squeeze(1), self.attr(h).flatten(1)


def train_dcgan(args, netG, netD, loader, device):
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(64, args.nz, 1, 1, device=device)
    optimizerD = optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    scaler = torch.amp.GradScaler("cuda")

    for epoch in range(args.niter):
        for i, (real, _) in enumerate(loader):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = real.to(device)
            b = real.size(0)
            label = torch.full((b,), REAL_LABEL, dtype=torch.float, device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                output = netD(real).view(-1)
                errD_real = criterion(output, label)  # expect: AMP003
                scaler.scale(errD_real).backward()  # expect: AMP008
                D_x = output.float().mean().item()

                noise = torch.randn(b, args.nz, 1, 1, device=device)
                fake = netG(noise)
                label.fill_(FAKE_LABEL)
                output = netD(fake.detach()).view(-1)
                errD_fake = criterion(output, label)  # expect: AMP003
                scaler.scale(errD_fake).backward()  # expect: AMP008
            errD = errD_real + errD_fake
            scaler.step(optimizerD)

            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(REAL_LABEL)
            with torch.autocast("cuda", dtype=torch.float16):
                output = netD(fake).view(-1)
                errG = criterion(output, label)  # expect: AMP003
            scaler.scale(errG).backward()
            scaler.step(optimizerG)
            scaler.update()

            if i % 50 == 0:
                print(f"[{epoch}/{args.niter}][{i}/{len(loader)}] Loss_D: {errD.item():.4f} "
                      f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f}")
            if i % 500 == 0:
                save_samples(netG, fixed_noise, os.path.join(args.outf, f"fake_e{epoch:03d}_{i:05d}.png"))
        torch.save(netG.state_dict(), os.path.join(args.outf, f"netG_epoch_{epoch}.pth"))
        torch.save(netD.state_dict(), os.path.join(args.outf, f"netD_epoch_{epoch}.pth"))


def train_ns_r1(args, netG, netD, loader, device):
    """Non-saturating loss with lazy R1 and an auxiliary attribute loss."""
    opt_d = optim.Adam(netD.parameters(), lr=args.lr, betas=(0.0, 0.99))
    opt_g = optim.Adam(netG.parameters(), lr=args.lr, betas=(0.0, 0.99))
    scaler = torch.amp.GradScaler("cuda")
    fixed_noise = torch.randn(64, args.nz, 1, 1, device=device)
    step = 0
    for epoch in range(args.niter):
        for real, attrs in loader:
            real, attrs = real.to(device), attrs.to(device).float()
            b = real.size(0)

            # discriminator
            opt_d.zero_grad(set_to_none=True)
            noise = torch.randn(b, args.nz, 1, 1, device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                fake = netG(noise).detach()
                real_logits, attr_logits = netD(real)
                fake_logits, _ = netD(fake)
                d_loss = F.softplus(fake_logits.float()).mean() + F.softplus(-real_logits.float()).mean()
                with torch.autocast("cuda", enabled=False):
                    attr_probs = torch.sigmoid(attr_logits.float())
                    attr_loss = F.binary_cross_entropy(attr_probs, attrs)
                d_total = d_loss + args.attr_weight * attr_loss
            scaler.scale(d_total).backward()

            if step % args.r1_every == 0:
                real.requires_grad_(True)
                with torch.autocast("cuda", dtype=torch.float16):
                    real_logits, _ = netD(real)
                # scale the outputs for autograd.grad, then unscale the result by hand
                (scaled_grad,) = torch.autograd.grad(
                    outputs=scaler.scale(real_logits.float().sum()), inputs=real, create_graph=True)
                grad = scaled_grad / scaler.get_scale()
                r1 = grad.pow(2).flatten(1).sum(1).mean()
                scaler.scale(args.r1_gamma / 2 * r1 * args.r1_every).backward()
            scaler.step(opt_d)

            # generator
            opt_g.zero_grad(set_to_none=True)
            noise = torch.randn(b, args.nz, 1, 1, device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                fake_logits, _ = netD(netG(noise))
                g_loss = F.softplus(-fake_logits.float()).mean()
            scaler.scale(g_loss).backward()
            opt_g.step()  # expect: AMP006
            scaler.update()
            step += 1

            if step % 100 == 0:
                print(f"step {step}: d {d_loss.item():.3f} attr {attr_loss.item():.3f} g {g_loss.item():.3f} "
                      f"scale {scaler.get_scale():.0f}")
            if step % 2000 == 0:
                save_samples(netG, fixed_noise, os.path.join(args.outf, f"ns_{step:07d}.png"))


@torch.no_grad()
def save_samples(netG, noise, path):
    was_training = netG.training
    netG.eval()
    fake = netG(noise).float()
    vutils.save_image(fake, path, normalize=True)
    netG.train(was_training)


@torch.no_grad()
def evaluate_discriminator(netD, loader, netG, nz, device):
    """Real/fake BCE of the discriminator on held-out data (fp32)."""
    netD.eval()
    total, n = 0.0, 0
    for real, _ in loader:
        real = real.to(device)
        fake = netG(torch.randn(real.size(0), nz, 1, 1, device=device))
        probs = torch.cat([netD(real).view(-1), netD(fake).view(-1)])
        targets = torch.cat([torch.ones(real.size(0), device=device), torch.zeros(real.size(0), device=device)])
        total += F.binary_cross_entropy(probs, targets, reduction="sum").item()
        n += targets.numel()
    netD.train()
    return total / n


def export_generator(netG, path):
    g = copy.deepcopy(netG).half().eval()
    torch.save(g.state_dict(), path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataroot", required=True)
    parser.add_argument("--loss", choices=["bce", "ns"], default="bce")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--nz", type=int, default=100)
    parser.add_argument("--niter", type=int, default=25)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--r1-gamma", type=float, default=10.0)
    parser.add_argument("--r1-every", type=int, default=16)
    parser.add_argument("--attr-weight", type=float, default=1.0)
    parser.add_argument("--outf", default="out")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else random.randint(1, 10000)
    random.seed(seed)
    torch.manual_seed(seed)
    os.makedirs(args.outf, exist_ok=True)
    device = torch.device("cuda")

    dataset = build_dataset(args.dataroot, args.image_size, with_attrs=args.loss == "ns")
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                         num_workers=4, drop_last=True)
    netG = Generator(args.nz).to(device)
    netG.apply(weights_init)
    if args.loss == "bce":
        netD = Discriminator().to(device)
        netD.apply(weights_init)
        train_dcgan(args, netG, netD, loader, device)
    else:
        netD = AttrDiscriminator().to(device)
        netD.apply(weights_init)
        train_ns_r1(args, netG, netD, loader, device)
    export_generator(netG, os.path.join(args.outf, "generator_fp16.pth"))


if __name__ == "__main__":
    main()
