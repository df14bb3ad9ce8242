"""Convolutional autoencoder for industrial anomaly detection (MVTec-style).

The encoder's latent codes of normal training images are fitted with a Gaussian;
test images are scored by reconstruction error plus Mahalanobis distance of the latent.
"""
import argparse
import json
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from datasets.mvtec import MVTecDataset

logger = logging.getLogger("anomaly_ae")


@dataclass
class AEConfig:
    in_channels: int = 3
    base_channels: int = 32
    latent_dim: int = 128
    image_size: int = 128
    batch_whiten: bool = True
    lr: float = 2e-4
    epochs: int = 100
    batch_size: int = 32
    recon_weight: float = 1.0
    latent_weight: float = 0.1
    sparsity_target: float = 0.05
    sparsity_weight: float = 1e-3


def conv_block(c_in, c_out, down=True):
    conv = nn.Conv2d(c_in, c_out, 4, 2, 1) if down else nn.ConvTranspose2d(c_in, c_out, 4, 2, 1)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out), nn.LeakyReLU(0.2, inplace=True))


class Encoder(nn.Module):
    def __init__(self, cfg: AEConfig):
        super().__init__()
        c = cfg.base_channels
        self.features = nn.Sequential(
            conv_block(cfg.in_channels, c), conv_block(c, 2 * c), conv_block(2 * c, 4 * c), conv_block(4 * c, 8 * c)
        )
        spatial = cfg.image_size // 16
        self.to_latent = nn.Linear(8 * c * spatial * spatial, cfg.latent_dim)
        self.batch_whiten = cfg.batch_whiten

    def forward(self, x):
        h = self.features(x).flatten(1)
        z = self.to_latent(h)
        if self.batch_whiten and self.training:
            z = self._whiten(z)
        return z

    def _whiten(self, z):
        mu = z.mean(dim=0, keepdim=True)  # expect: AMP004
        sd = z.std(dim=0, keepdim=True)  # expect: AMP004
        return (z - mu) / (sd + 1e-8)  # expect: AMP011


class Decoder(nn.Module):
    def __init__(self, cfg: AEConfig):
        super().__init__()
        c = cfg.base_channels
        self.spatial = cfg.image_size // 16
        self.from_latent = nn.Linear(cfg.latent_dim, 8 * c * self.spatial * self.spatial)
        self.up = nn.Sequential(conv_block(8 * c, 4 * c, down=False), conv_block(4 * c, 2 * c, down=False),
                                conv_block(2 * c, c, down=False))
        self.out = nn.ConvTranspose2d(c, cfg.in_channels, 4, 2, 1)

    def forward(self, z):
        h = self.from_latent(z).view(z.size(0), -1, self.spatial, self.spatial)
        return self.out(self.up(h))


class AnomalyAE(nn.Module):
    def __init__(self, cfg: AEConfig):
        super().__init__()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.rho = cfg.sparsity_target
        self.sparsity_weight = cfg.sparsity_weight

    def _kl_sparsity(self, z):
        # KL(rho || rho_hat) between target and mean activation of each latent unit
        rho_hat = torch.sigmoid(z).mean(dim=0)  # expect: AMP004
        kl = self.rho * torch.log(self.rho / (rho_hat + 1e-10))  # expect: AMP011
        kl = kl + (1 - self.rho) * torch.log((1 - self.rho) / (1 - rho_hat + 1e-10))  # expect: AMP011
        return kl.sum()

    def forward(self, x):
        z = self.encoder(x)
        recon = self.decoder(z)
        out = {"recon": recon, "latent": z}
        if self.training and self.sparsity_weight > 0:
            out["sparsity"] = self.sparsity_weight * self._kl_sparsity(z)
        return out


class GaussianScorer:
    """Mahalanobis distance of latent codes to the fitted normal-class Gaussian."""

    def __init__(self, shrinkage=0.01):
        self.shrinkage = shrinkage
        self.mean = None
        self.precision = None

    def fit(self, latents):
        latents = latents.double()
        self.mean = latents.mean(dim=0)
        centered = latents - self.mean
        cov = centered.T @ centered / (latents.size(0) - 1)
        cov = (1 - self.shrinkage) * cov + self.shrinkage * torch.eye(cov.size(0), dtype=cov.dtype) * cov.diagonal().mean()
        self.precision = torch.linalg.inv(cov)

    def score(self, z):
        d = z.double() - self.mean
        return torch.einsum("bi,ij,bj->b", d, self.precision, d).clamp_min(0).sqrt()

    def state_dict(self):
        return {"mean": self.mean, "precision": self.precision, "shrinkage": self.shrinkage}


def make_amp_context(use_amp):
    if use_amp:
        return torch.autocast(device_type="cuda", dtype=torch.float16)
    return nullcontext()


def train_epoch(model, loader, optimizer, scaler, cfg, args, epoch):
    model.train()
    running = 0.0
    for i, batch in enumerate(loader):
        images = batch["image"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            out = model(images)
            latent_reg = out["latent"].float().pow(2).mean()
        recon_loss = F.mse_loss(out["recon"], images)  # expect: AMP002
        loss = cfg.recon_weight * recon_loss + cfg.latent_weight * latent_reg
        if "sparsity" in out:
            loss = loss + out["sparsity"]

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        running += loss.item()
        if i % args.log_interval == 0:
            logger.info("epoch %d [%d/%d] loss %.5f scale %.0f", epoch, i, len(loader), loss.item(), scaler.get_scale())
    return running / max(len(loader), 1)


@torch.no_grad()
def collect_latents(model, loader, use_amp):
    model.eval()
    zs = []
    for batch in loader:
        with make_amp_context(use_amp):
            z = model.encoder(batch["image"].cuda(non_blocking=True))
        zs.append(z.float().cpu())
    return torch.cat(zs)


@torch.no_grad()
def evaluate(model, scorer, loader, use_amp, alpha=0.5):
    model.eval()
    scores, labels = [], []
    for batch in loader:
        images = batch["image"].cuda(non_blocking=True)
        with make_amp_context(use_amp):
            out = model(images)
        err = (out["recon"].float() - images).pow(2).flatten(1).mean(dim=1)
        maha = scorer.score(out["latent"].float().cpu())
        scores.append((alpha * err.cpu().double() + (1 - alpha) * maha).numpy())
        labels.append(batch["label"].numpy())
    scores, labels = np.concatenate(scores), np.concatenate(labels)
    return roc_auc_score(labels, scores), scores


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/data/mvtec")
    parser.add_argument("--category", default="bottle")
    parser.add_argument("--out", default="runs/ae")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    cfg = AEConfig(**json.load(open(args.config))) if args.config else AEConfig()
    train_set = MVTecDataset(args.root, args.category, split="train", size=cfg.image_size)
    test_set = MVTecDataset(args.root, args.category, split="test", size=cfg.image_size)
    train_loader = torch.utils.data.DataLoader(train_set, cfg.batch_size, shuffle=True, num_workers=4, drop_last=True)
    fit_loader = torch.utils.data.DataLoader(train_set, cfg.batch_size, shuffle=False, num_workers=4)
    test_loader = torch.utils.data.DataLoader(test_set, cfg.batch_size, shuffle=False, num_workers=4)

    model = AnomalyAE(cfg).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.5, 0.999))
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(cfg.epochs):
        train_loss = train_epoch(model, train_loader, optimizer, scaler, cfg, args, epoch)
        if (epoch + 1) % 10 == 0 or epoch == cfg.epochs - 1:
            scorer = GaussianScorer()
            scorer.fit(collect_latents(model, fit_loader, args.amp))
            auc, _ = evaluate(model, scorer, test_loader, args.amp)
            logger.info("epoch %d loss %.5f image AUROC %.4f", epoch, train_loss, auc)
            if auc > best_auc:
                best_auc = auc
                torch.save({"model": model.state_dict(), "scorer": scorer.state_dict(), "cfg": cfg.__dict__},
                           os.path.join(args.out, f"{args.category}_best.pt"))


if __name__ == "__main__":
    main()
