"""
Conditional GAN trainer (projection discriminator + auxiliary attribute head) for
256x256 face generation on CelebA-HQ attributes.

Non-saturating logistic loss, generator EMA, bf16 autocast on A100/H100.

    python train_gan.py --data /data/celebahq --batch 32 --steps 200000
"""
import argparse
import copy
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from torchvision.utils import save_image

from gan.data import AttributeImageFolder, infinite_loader
from gan.metrics import FIDEvaluator
from gan.networks import Discriminator, Generator

log = logging.getLogger("gan")


@dataclass
class GANConfig:
    data: str = "/data/celebahq"
    out: str = "runs/gan"
    resolution: int = 256
    z_dim: int = 512
    n_attrs: int = 40
    batch: int = 32
    steps: int = 200_000
    lr_g: float = 2e-4
    lr_d: float = 2e-4
    betas: tuple = (0.0, 0.99)
    aux_weight: float = 1.0
    ema_kimg: float = 10.0
    log_every: int = 100
    sample_every: int = 2000
    fid_every: int = 10_000
    ckpt_every: int = 10_000
    workers: int = 8
    extra: dict = field(default_factory=dict)


class GANTrainer:
    def __init__(self, cfg: GANConfig, device="cuda"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.G = Generator(cfg.z_dim, cfg.n_attrs, cfg.resolution).to(self.device)
        self.D = Discriminator(cfg.n_attrs, cfg.resolution).to(self.device)
        self.G_ema = copy.deepcopy(self.G).eval().requires_grad_(False)

        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=cfg.lr_g, betas=cfg.betas)
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=cfg.lr_d, betas=cfg.betas)
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        self.aux_criterion = nn.BCELoss()

        self.step = 0
        self.writer = SummaryWriter(cfg.out)
        self.fixed_z = torch.randn(64, cfg.z_dim, device=self.device)
        self.fixed_attrs = None

    # ------------------------------------------------------------------ utils
    def sample_z(self, n):
        return torch.randn(n, self.cfg.z_dim, device=self.device)

    @torch.no_grad()
    def update_ema(self):
        beta = 0.5 ** (self.cfg.batch / max(self.cfg.ema_kimg * 1000, 1e-8))
        for p_ema, p in zip(self.G_ema.parameters(), self.G.parameters()):
            p_ema.lerp_(p.detach(), 1.0 - beta)
        for b_ema, b in zip(self.G_ema.buffers(), self.G.buffers()):
            b_ema.copy_(b)

    # ------------------------------------------------------------------ steps
    def d_step(self, real, attrs):
        real = real.to(self.device, dtype=torch.bfloat16)  # expect: AMP001
        attrs = attrs.to(self.device)
        z = self.sample_z(real.size(0))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                fake = self.G(z, attrs)
            real_logits, real_attr_logits = self.D(real, attrs)
            fake_logits, _ = self.D(fake.detach(), attrs)
            adv = F.softplus(fake_logits) + F.softplus(-real_logits)
            aux = self.aux_criterion(torch.sigmoid(real_attr_logits), attrs.float())  # expect: AMP003
            loss_d = adv.mean() + self.cfg.aux_weight * aux
        self.opt_d.zero_grad(set_to_none=True)
        self.scaler.scale(loss_d).backward()
        self.scaler.step(self.opt_d)
        self.scaler.update()
        return {"loss_d": loss_d.item(), "aux": aux.item()}

    def g_step(self, attrs):
        attrs = attrs.to(self.device)
        z = self.sample_z(attrs.size(0)).bfloat16()  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fake = self.G(z, attrs)
            fake_logits, fake_attr_logits = self.D(fake, attrs)
            adv = F.softplus(-fake_logits)
            aux = F.binary_cross_entropy_with_logits(fake_attr_logits, attrs.float())
            loss_g = adv.mean() + self.cfg.aux_weight * aux
        self.opt_g.zero_grad(set_to_none=True)
        self.scaler.scale(loss_g).backward()
        self.scaler.step(self.opt_g)
        self.scaler.update()
        return {"loss_g": loss_g.item()}

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def sample_grid(self, path):
        if self.fixed_attrs is None:
            return
        with torch.autocast("cuda", dtype=torch.float16):
            imgs = self.G_ema(self.fixed_z.half(), self.fixed_attrs)
        save_image(imgs.float().clamp(-1, 1) * 0.5 + 0.5, path, nrow=8)

    @torch.no_grad()
    def compute_fid(self, evaluator, n=10_000):
        feats = []
        for i in range(0, n, 100):
            attrs = evaluator.sample_attrs(100).to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                imgs = self.G_ema(self.sample_z(100), attrs)
            feats.append(evaluator.features(imgs.float()))
        return evaluator.fid(torch.cat(feats))

    # ------------------------------------------------------------------ io
    def save(self, path):
        torch.save(
            {
                "G": self.G.state_dict(),
                "D": self.D.state_dict(),
                "G_ema": self.G_ema.state_dict(),
                "opt_g": self.opt_g.state_dict(),
                "opt_d": self.opt_d.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": self.step,
                "cfg": asdict(self.cfg),
            },
            path,
        )

    def load(self, path):
        ckpt = torch.load(path, map_location=self.device)
        self.G.load_state_dict(ckpt["G"])
        self.D.load_state_dict(ckpt["D"])
        self.G_ema.load_state_dict(ckpt["G_ema"])
        self.opt_g.load_state_dict(ckpt["opt_g"])
        self.opt_d.load_state_dict(ckpt["opt_d"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.step = ckpt["step"]

    def export_generator(self, path):
        deploy = copy.deepcopy(self.G_ema).half()
        torch.save({"G": deploy.state_dict(), "z_dim": self.cfg.z_dim}, path)

    # ------------------------------------------------------------------ loop
    def train(self, loader, evaluator=None):
        out = Path(self.cfg.out)
        (out / "samples").mkdir(parents=True, exist_ok=True)
        self.G.train()
        self.D.train()
        it = infinite_loader(loader)
        t0 = time.time()
        best_fid = 1e9
        while self.step < self.cfg.steps:
            real, attrs = next(it)
            if self.fixed_attrs is None:
                self.fixed_attrs = attrs[:64].to(self.device)
            stats = self.d_step(real, attrs)
            stats.update(self.g_step(attrs))
            self.update_ema()
            self.step += 1

            if self.step % self.cfg.log_every == 0:
                for k, v in stats.items():
                    self.writer.add_scalar(f"train/{k}", v, self.step)
                self.writer.add_scalar("train/scale", self.scaler.get_scale(), self.step)
                log.info("step %d %s (%.2f it/s)", self.step, stats, self.cfg.log_every / (time.time() - t0))
                t0 = time.time()
            if self.step % self.cfg.sample_every == 0:
                self.sample_grid(out / "samples" / f"{self.step:07d}.png")
            if evaluator is not None and self.step % self.cfg.fid_every == 0:
                fid = self.compute_fid(evaluator)
                self.writer.add_scalar("eval/fid", fid, self.step)
                if fid < best_fid:
                    best_fid = fid
                    self.export_generator(out / "G_ema_best_fp16.pt")
            if self.step % self.cfg.ckpt_every == 0:
                self.save(out / "last.pt")
        self.save(out / "last.pt")
        return best_fid


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=GANConfig.data)
    p.add_argument("--out", default=GANConfig.out)
    p.add_argument("--batch", type=int, default=GANConfig.batch)
    p.add_argument("--steps", type=int, default=GANConfig.steps)
    p.add_argument("--resume", default="")
    p.add_argument("--fid-stats", default="")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GANConfig(data=args.data, out=args.out, batch=args.batch, steps=args.steps)
    dataset = AttributeImageFolder(cfg.data, resolution=cfg.resolution)
    loader = DataLoader(dataset, batch_size=cfg.batch, shuffle=True, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    trainer = GANTrainer(cfg)
    if args.resume:
        trainer.load(args.resume)
    evaluator = FIDEvaluator(args.fid_stats, device="cuda") if args.fid_stats else None
    best = trainer.train(loader, evaluator)
    log.info("done, best FID %.2f", best)


if __name__ == "__main__":
    main()
