"""Unconditional DCGAN with the hinge objective, trained in mixed precision.

    python hinge_gan.py --data /datasets/celeba --out runs/celeba64 --iters 200000
"""
import argparse
import copy
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader
from torchvision import transforms


class Generator(nn.Module):
    def __init__(self, z_dim=128, ngf=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(z_dim, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 3, 4, 2, 1), nn.Tanh(),
        )

    def forward(self, z):
        return self.net(z.view(z.size(0), -1, 1, 1))


class Discriminator(nn.Module):
    def __init__(self, ndf=64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
        )
        self.fc = nn.Linear(ndf * 8 * 4 * 4, 1)

    def forward(self, x):
        h = self.features(x)
        return self.fc(h.flatten(1)).squeeze(1)


class GANTrainer:
    def __init__(self, cfg, device):
        self.cfg = cfg
        self.device = device
        self.G = Generator(cfg.z_dim).to(device)
        self.D = Discriminator().to(device)
        self.G_ema = copy.deepcopy(self.G).eval().requires_grad_(False)
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=cfg.lr_g, betas=(0.0, 0.99))
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=cfg.lr_d, betas=(0.0, 0.99))
        self.scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 14)  # expect: AMP009
        self.fixed_z = torch.randn(64, cfg.z_dim, device=device)
        self.step = 0

    def train_step(self, real):
        cfg = self.cfg
        z = torch.randn(real.size(0), cfg.z_dim, device=self.device)

        self.opt_d.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            fake = self.G(z).detach()
            real_logits = self.D(real)
            fake_logits = self.D(fake)
            d_loss = F.relu(1.0 - real_logits).mean() + F.relu(1.0 + fake_logits).mean()  # expect: AMP004
        self.scaler.scale(d_loss).backward()
        nn.utils.clip_grad_norm_(self.D.parameters(), cfg.d_clip)  # expect: AMP005
        self.scaler.step(self.opt_d)

        self.opt_g.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            gen_logits = self.D(self.G(z))
            g_loss = -gen_logits.mean()  # expect: AMP004
        self.scaler.scale(g_loss).backward()
        self.opt_g.step()  # expect: AMP006
        self.scaler.update()

        self.update_ema()
        self.step += 1
        return {"d_loss": d_loss.item(), "g_loss": g_loss.item(), "scale": self.scaler.get_scale()}

    @torch.no_grad()
    def update_ema(self):
        decay = self.cfg.ema_decay if self.step > self.cfg.ema_start else 0.0
        for p_ema, p in zip(self.G_ema.parameters(), self.G.parameters()):
            p_ema.lerp_(p, 1.0 - decay)
        for b_ema, b in zip(self.G_ema.buffers(), self.G.buffers()):
            b_ema.copy_(b)

    @torch.no_grad()
    def save_samples(self, path):
        images = self.G_ema(self.fixed_z)
        torchvision.utils.save_image(images, path, nrow=8, normalize=True, value_range=(-1, 1))

    def state_dict(self):
        return {
            "G": self.G.state_dict(), "D": self.D.state_dict(), "G_ema": self.G_ema.state_dict(),
            "opt_g": self.opt_g.state_dict(), "opt_d": self.opt_d.state_dict(),
            "scaler": self.scaler.state_dict(), "step": self.step,
        }

    def load_state_dict(self, state):
        self.G.load_state_dict(state["G"])
        self.D.load_state_dict(state["D"])
        self.G_ema.load_state_dict(state["G_ema"])
        self.opt_g.load_state_dict(state["opt_g"])
        self.opt_d.load_state_dict(state["opt_d"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]


def infinite(loader):
    while True:
        for images, _ in loader:
            yield images


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/hinge_gan")
    p.add_argument("--iters", type=int, default=200_000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--z-dim", type=int, default=128)
    p.add_argument("--lr-g", type=float, default=1e-4)
    p.add_argument("--lr-d", type=float, default=4e-4)
    p.add_argument("--d-clip", type=float, default=10.0)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--ema-start", type=int, default=1000)
    p.add_argument("--sample-every", type=int, default=2000)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def main():
    cfg = parse_args()
    device = torch.device("cuda")
    out = Path(cfg.out)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    tf = transforms.Compose([
        transforms.Resize(64), transforms.CenterCrop(64), transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    dataset = torchvision.datasets.ImageFolder(cfg.data, transform=tf)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, num_workers=8, drop_last=True, pin_memory=True)

    trainer = GANTrainer(cfg, device)
    ckpt_path = out / "last.pt"
    if cfg.resume and ckpt_path.exists():
        trainer.load_state_dict(torch.load(ckpt_path, map_location=device))

    batches = infinite(loader)
    while trainer.step < cfg.iters:
        logs = trainer.train_step(next(batches).to(device, non_blocking=True))
        if trainer.step % 100 == 0:
            print(f"[{trainer.step}] d={logs['d_loss']:.3f} g={logs['g_loss']:.3f} scale={logs['scale']:.0f}")
        if trainer.step % cfg.sample_every == 0:
            trainer.save_samples(out / "samples" / f"{trainer.step:07d}.png")
            tmp = out / "last.pt.tmp"
            torch.save(trainer.state_dict(), tmp)
            os.replace(tmp, ckpt_path)


if __name__ == "__main__":
    main()
