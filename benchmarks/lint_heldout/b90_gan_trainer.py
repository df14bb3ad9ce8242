"""DCGAN-style trainer for 64x64 image folders with mixed precision.

    python gan_trainer.py --data ~/datasets/celeba --epochs 25 --batch-size 128
"""
import argparse
import copy
import os
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision import utils as vutils


@dataclass
class GANConfig:
    z_dim: int = 128
    ngf: int = 64
    ndf: int = 64
    lr_g: float = 2e-4
    lr_d: float = 2e-4
    ema_decay: float = 0.999
    clip_d: Optional[float] = 10.0
    scaler_growth_interval: int = 1000


class Generator(nn.Module):
    def __init__(self, z_dim=128, ngf=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(z_dim, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 3, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, z):
        return self.net(z.view(z.size(0), -1, 1, 1))


class Discriminator(nn.Module):
    def __init__(self, ndf=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
        )

    def forward(self, x):
        return self.net(x).view(-1)


class GANTrainer:
    def __init__(self, cfg: GANConfig, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.G = Generator(cfg.z_dim, cfg.ngf).to(device)
        self.D = Discriminator(cfg.ndf).to(device)
        self.G_ema = copy.deepcopy(self.G).eval().requires_grad_(False)
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=cfg.lr_g, betas=(0.5, 0.999))
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=cfg.lr_d, betas=(0.5, 0.999))
        self.autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)
        self.scaler = torch.amp.GradScaler("cuda", growth_interval=cfg.scaler_growth_interval)
        self.step = 0

    def d_step(self, real):
        z = torch.randn(real.size(0), self.cfg.z_dim, device=self.device)
        with self.autocast():
            fake = self.G(z).detach()
            logits_real = self.D(real)
            logits_fake = self.D(fake)
            loss_d = (F.binary_cross_entropy_with_logits(logits_real, torch.ones_like(logits_real))
                      + F.binary_cross_entropy_with_logits(logits_fake, torch.zeros_like(logits_fake)))
        self.opt_d.zero_grad(set_to_none=True)
        self.scaler.scale(loss_d).backward()
        if self.cfg.clip_d is not None:
            nn.utils.clip_grad_norm_(self.D.parameters(), self.cfg.clip_d)  # expect: AMP005
        self.scaler.step(self.opt_d)
        return loss_d.detach()

    def g_step(self, batch_size):
        z = torch.randn(batch_size, self.cfg.z_dim, device=self.device)
        with self.autocast():
            fake = self.G(z)
            logits = self.D(fake)
        loss_g = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))  # expect: AMP002
        self.opt_g.zero_grad(set_to_none=True)
        self.scaler.scale(loss_g).backward()
        self.opt_g.step()  # expect: AMP006
        return loss_g.detach()

    @torch.no_grad()
    def update_ema(self):
        decay = min(self.cfg.ema_decay, (1 + self.step) / (10 + self.step))
        for p_ema, p in zip(self.G_ema.parameters(), self.G.parameters()):
            p_ema.lerp_(p, 1.0 - decay)
        for b_ema, b in zip(self.G_ema.buffers(), self.G.buffers()):
            b_ema.copy_(b)

    def train_step(self, real):
        real = real.to(self.device, non_blocking=True).half()  # expect: AMP001
        loss_d = self.d_step(real)
        loss_g = self.g_step(real.size(0))
        # one update per iteration, after both optimizers have stepped
        self.scaler.update()
        self.update_ema()
        self.step += 1
        return loss_d, loss_g

    @torch.inference_mode()
    def sample(self, n=64):
        z = torch.randn(n, self.cfg.z_dim, device=self.device)
        with self.autocast():
            imgs = self.G_ema(z)
        return imgs.float().clamp_(-1, 1)

    def state_dict(self):
        return {
            "G": self.G.state_dict(), "D": self.D.state_dict(), "G_ema": self.G_ema.state_dict(),
            "opt_g": self.opt_g.state_dict(), "opt_d": self.opt_d.state_dict(),
            "scaler": self.scaler.state_dict(), "step": self.step,
        }

    def load_state_dict(self, sd):
        self.G.load_state_dict(sd["G"])
        self.D.load_state_dict(sd["D"])
        self.G_ema.load_state_dict(sd["G_ema"])
        self.opt_g.load_state_dict(sd["opt_g"])
        self.opt_d.load_state_dict(sd["opt_d"])
        self.scaler.load_state_dict(sd["scaler"])
        self.step = sd["step"]

    def export_generator(self, path):
        # compact copy of the averaged generator for the demo page
        g = copy.deepcopy(self.G_ema).half()
        torch.save(g.state_dict(), path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/dcgan")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--resume", default="")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    tf = transforms.Compose([
        transforms.Resize(64), transforms.CenterCrop(64), transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    loader = DataLoader(datasets.ImageFolder(args.data, tf), batch_size=args.batch_size,
                        shuffle=True, num_workers=4, drop_last=True, pin_memory=True)
    trainer = GANTrainer(GANConfig())
    if args.resume:
        trainer.load_state_dict(torch.load(args.resume, map_location="cuda"))

    for epoch in range(args.epochs):
        for i, (real, _) in enumerate(loader):
            loss_d, loss_g = trainer.train_step(real)
            if i % 100 == 0:
                print(f"[{epoch}/{args.epochs}][{i}/{len(loader)}] D {loss_d.item():.3f} "
                      f"G {loss_g.item():.3f} scale {trainer.scaler.get_scale():.0f}")
        vutils.save_image(trainer.sample(), os.path.join(args.out, f"epoch_{epoch:03d}.png"),
                          normalize=True, value_range=(-1, 1))
        torch.save(trainer.state_dict(), os.path.join(args.out, "last.pt"))
    trainer.export_generator(os.path.join(args.out, "generator_ema_fp16.pt"))


if __name__ == "__main__":
    main()
