"""DCGAN with mixed precision.

    python train_dcgan.py --dataroot /data/celeba --outf runs/celeba64 --amp

Generator / discriminator follow Radford et al. (2015); the discriminator uses a
scaled leaky ReLU computed in fp32 so that its output stays well behaved in fp16.
"""
import argparse
import copy
import functools
import logging
import math
import os
import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
import torchvision.datasets as dset
import torchvision.transforms as T
import torchvision.utils as vutils

from gan_lib.metrics import FIDEvaluator

logger = logging.getLogger("dcgan")

REAL_LABEL = 1.0
FAKE_LABEL = 0.0


@dataclass
class GANConfig:
    nz: int = 100
    ngf: int = 64
    ndf: int = 64
    nc: int = 3
    lr: float = 2e-4
    beta1: float = 0.5
    amp: bool = True
    d_clip: float = 10.0


def make_grad_scaler(device_type: str, enabled: bool):
    try:
        return torch.amp.GradScaler(device_type, enabled=enabled)
    except (AttributeError, TypeError):
        # torch < 2.3 has no device-generic scaler
        return torch.cuda.amp.GradScaler(enabled=enabled)


class _ScaledLeakyReLU(torch.autograd.Function):
    """leaky_relu(x) * sqrt(2), forward and backward in fp32."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x, negative_slope):
        out = F.leaky_relu(x, negative_slope) * math.sqrt(2.0)
        ctx.negative_slope = negative_slope
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        (out,) = ctx.saved_tensors
        grad = torch.where(out > 0, grad_output, grad_output * ctx.negative_slope) * math.sqrt(2.0)
        return grad, None


class ScaledLeakyReLU(nn.Module):
    def __init__(self, negative_slope: float = 0.2):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x):
        return _ScaledLeakyReLU.apply(x, self.negative_slope)


class Generator(nn.Module):
    def __init__(self, cfg: GANConfig):
        super().__init__()
        nz, ngf, nc = cfg.nz, cfg.ngf, cfg.nc
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, cfg: GANConfig):
        super().__init__()
        ndf, nc = cfg.ndf, cfg.nc
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            ScaledLeakyReLU(0.2),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            ScaledLeakyReLU(0.2),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            ScaledLeakyReLU(0.2),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            ScaledLeakyReLU(0.2),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x):
        return self.main(x)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class CheckpointMixin:
    ckpt_keys = ()

    def state_dict(self):
        return {k: getattr(self, k).state_dict() for k in self.ckpt_keys}

    def load_state_dict(self, state):
        for k in self.ckpt_keys:
            if k in state:
                getattr(self, k).load_state_dict(state[k])
            else:
                logger.warning("checkpoint has no %r, keeping fresh state", k)

    def save(self, path, **extra):
        torch.save({**self.state_dict(), **extra}, path)

    def resume(self, path) -> int:
        state = torch.load(path, map_location="cpu")
        self.load_state_dict(state)
        return state.get("epoch", 0)


class GANTrainer(CheckpointMixin):
    ckpt_keys = ("netG", "netD", "opt_g", "opt_d", "scaler")

    def __init__(self, netG: nn.Module, netD: nn.Module, cfg: GANConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.netG = netG.to(device)
        self.netD = netD.to(device)
        self.opt_g = optim.Adam(self.netG.parameters(), lr=cfg.lr, betas=(cfg.beta1, 0.999))
        self.opt_d = optim.Adam(self.netD.parameters(), lr=cfg.lr, betas=(cfg.beta1, 0.999))
        self.criterion = nn.BCELoss()
        self.autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.float16,
                                          enabled=cfg.amp)
        self.scaler = make_grad_scaler(device.type, cfg.amp)
        self.fixed_noise = torch.randn(64, cfg.nz, 1, 1, device=device)

    def d_step(self, real):
        b = real.size(0)
        noise = torch.randn(b, self.cfg.nz, 1, 1, device=self.device)
        targets = torch.cat([
            torch.full((b,), REAL_LABEL, device=self.device),
            torch.full((b,), FAKE_LABEL, device=self.device),
        ])
        self.opt_d.zero_grad(set_to_none=True)
        with self.autocast():
            fake = self.netG(noise)
            scores = self.netD(torch.cat([real, fake.detach()])).view(-1)
            loss_d = self.criterion(scores, targets)  # expect: AMP003
        self.scaler.scale(loss_d).backward()
        if self.cfg.d_clip > 0:
            self.scaler.unscale_(self.opt_d)
            nn.utils.clip_grad_norm_(self.netD.parameters(), self.cfg.d_clip)
        self.scaler.step(self.opt_d)
        self.scaler.update()
        d_x = scores[:b].float().mean().item()
        d_g_z1 = scores[b:].float().mean().item()
        return fake, loss_d.detach(), d_x, d_g_z1

    def g_step(self, fake):
        b = fake.size(0)
        real_targets = torch.full((b,), REAL_LABEL, device=self.device)
        self.opt_g.zero_grad(set_to_none=True)
        with self.autocast():
            scores = self.netD(fake).view(-1)
            loss_g = self.criterion(scores, real_targets)  # expect: AMP003
        self.scaler.scale(loss_g).backward()
        self.opt_g.step()  # expect: AMP006
        return loss_g.detach(), scores.float().mean().item()

    @torch.no_grad()
    def sample(self, noise=None):
        self.netG.eval()
        with self.autocast():
            imgs = self.netG(self.fixed_noise if noise is None else noise).float()
        self.netG.train()
        return imgs


def export_generator(netG: nn.Module, path: str) -> None:
    """Write a half-precision copy of the generator for the demo server."""
    g = copy.deepcopy(netG).eval().half()
    torch.save(g.state_dict(), path)


def build_loader(args):
    dataset = dset.ImageFolder(
        root=args.dataroot,
        transform=T.Compose([
            T.Resize(args.image_size),
            T.CenterCrop(args.image_size),
            T.ToTensor(),
            T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]),
    )
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                       num_workers=args.workers, pin_memory=True, drop_last=True)


def train(args):
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.outf, exist_ok=True)

    cfg = GANConfig(nz=args.nz, ngf=args.ngf, ndf=args.ndf, lr=args.lr, beta1=args.beta1, amp=args.amp)
    loader = build_loader(args)
    netG = Generator(cfg)
    netG.apply(weights_init)
    netD = Discriminator(cfg)
    netD.apply(weights_init)
    trainer = GANTrainer(netG, netD, cfg, device)
    start_epoch = trainer.resume(args.resume) if args.resume else 0

    fid = FIDEvaluator(args.fid_stats, device=device)
    best_fid = 1e9
    for epoch in range(start_epoch, args.niter):
        for i, (real, _) in enumerate(loader):
            real = real.to(device, non_blocking=True)
            fake, loss_d, d_x, d_g_z1 = trainer.d_step(real)
            loss_g, d_g_z2 = trainer.g_step(fake)
            if i % args.log_every == 0:
                logger.info("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f scale: %.0f",
                            epoch, args.niter, i, len(loader), loss_d.item(), loss_g.item(), d_x, d_g_z1, d_g_z2,
                            trainer.scaler.get_scale())

        vutils.save_image(trainer.sample(), f"{args.outf}/fake_samples_epoch_{epoch:03d}.png", normalize=True)
        score = fid.compute(trainer.netG, n_samples=args.fid_samples, nz=cfg.nz)
        logger.info("epoch %d FID %.2f", epoch, score)
        if score < best_fid:
            best_fid = score
            export_generator(trainer.netG, os.path.join(args.outf, "netG_best_fp16.pth"))
        trainer.save(os.path.join(args.outf, "last.pth"), epoch=epoch + 1, fid=score)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", required=True)
    p.add_argument("--outf", default="runs/dcgan")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--nz", type=int, default=100)
    p.add_argument("--ngf", type=int, default=64)
    p.add_argument("--ndf", type=int, default=64)
    p.add_argument("--niter", type=int, default=25)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default="")
    p.add_argument("--fid-stats", default="stats/celeba64.npz")
    p.add_argument("--fid-samples", type=int, default=10000)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=999)
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(parse_args())
