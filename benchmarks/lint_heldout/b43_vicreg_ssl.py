"""VICReg self-supervised pretraining, linear evaluation, fine-tuning and embedding export."""
import argparse
import copy
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


@dataclass
class VICRegConfig:
    feat_dim: int = 512
    proj_dim: int = 2048
    lr: float = 3e-4
    wd: float = 1e-6
    ft_lr: float = 1e-4
    sim_coeff: float = 25.0
    std_coeff: float = 25.0
    cov_coeff: float = 1.0
    num_classes: int = 100


class Backbone(nn.Module):
    def __init__(self, width=64, out_dim=512):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        )
        self.layers = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, 2, 1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.Conv2d(2 * width, out_dim, 3, 2, 1, bias=False), nn.BatchNorm2d(out_dim), nn.ReLU(inplace=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return torch.flatten(self.pool(self.layers(self.stem(x))), 1)


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class VICRegTrainer:
    def __init__(self, backbone, cfg, device):
        self.cfg, self.device = cfg, device
        self.backbone = backbone.to(device)
        self.projector = nn.Linear(cfg.feat_dim, cfg.proj_dim)
        self.projector.to(device)
        params = itertools.chain(self.backbone.parameters(), self.projector.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.wd)
        self.scaler = torch.amp.GradScaler("cuda")

    def training_step(self, x1, x2):
        cfg = self.cfg
        with torch.autocast("cuda", dtype=torch.float16):
            z1 = self.projector(self.backbone(x1))
            z2 = self.projector(self.backbone(x2))
            repr_loss = F.mse_loss(z1, z2)
            std_z1 = (z1.var(dim=0) + 1e-8).sqrt()  # expect: AMP004, AMP011
            std_z2 = torch.sqrt(z2.float().var(dim=0) + 1e-8)
            z1 = z1 - z1.mean(dim=0)  # expect: AMP004
            z2 = z2 - z2.float().mean(dim=0).to(z2.dtype)
            std_loss = F.relu(1 - std_z1.float()).mean() / 2 + F.relu(1 - std_z2).mean() / 2
            n, d = z1.shape
            cov_z1 = (z1.T @ z1) / (n - 1)
            cov_z2 = (z2.T @ z2) / (n - 1)
            cov_loss = off_diagonal(cov_z1).pow(2).sum() / d + off_diagonal(cov_z2).pow(2).sum() / d
            loss = cfg.sim_coeff * repr_loss + cfg.std_coeff * std_loss + cfg.cov_coeff * cov_loss
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()


def train_multicrop_epoch(trainer, loader, device):
    losses = []
    for views in loader:
        views = [v.to(device, non_blocking=True).half() for v in views]  # expect: AMP001
        losses.append(trainer.training_step(views[0], views[1]).item())
    return float(np.mean(losses))


def train_linear_eval(backbone, head, loader, device, epochs=10):
    backbone.eval()
    backbone.requires_grad_(False)
    backbone.half()
    optimizer = torch.optim.SGD(head.parameters(), lr=0.02, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        for images, labels in loader:
            with torch.no_grad():
                feats = backbone(images.to(device).half())
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(head(feats.float()), labels.to(device))
            scaler.scale(loss).backward()
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)


def finetune(backbone, head, loader, cfg, device):
    """Full fine-tuning after pretraining, bf16 weights to fit the larger batch."""
    backbone = backbone.bfloat16()  # expect: AMP001
    head = head.to(device)
    params = list(backbone.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.ft_lr)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    for images, labels in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = head(backbone(images.to(device)))
        loss = criterion(logits, labels.to(device))  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return backbone, head


def sanity_check_half_precision(projector, feats):
    """Projector outputs must agree in fp16 before mixed precision is switched on."""
    with torch.no_grad():
        ref = projector(feats)
    torch.testing.assert_close(projector(feats).half(), ref.half(), atol=1e-2, rtol=1e-2)


def export_embeddings(backbone, loader, path, device):
    encoder = copy.deepcopy(backbone).half().eval()
    chunks = []
    with torch.inference_mode():
        for images, _ in loader:
            chunks.append(encoder(images.to(device).half()).cpu().numpy().astype(np.float16))
    np.save(path, np.concatenate(chunks))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    cfg = VICRegConfig()
    images = torch.randn(512, 3, 64, 64)
    views = DataLoader(TensorDataset(images, images.flip(-1)), batch_size=64, shuffle=True, drop_last=True)
    labelled = DataLoader(TensorDataset(images, torch.randint(0, cfg.num_classes, (512,))), batch_size=64)
    trainer = VICRegTrainer(Backbone(out_dim=cfg.feat_dim), cfg, args.device)
    sanity_check_half_precision(trainer.projector, torch.randn(8, cfg.feat_dim, device=args.device))
    for epoch in range(args.epochs):
        print(f"epoch {epoch}: loss {train_multicrop_epoch(trainer, views, args.device):.4f}")
    head = nn.Linear(cfg.feat_dim, cfg.num_classes).to(args.device)
    train_linear_eval(copy.deepcopy(trainer.backbone), head, labelled, args.device)
    export_embeddings(trainer.backbone, labelled, "embeddings.npy", args.device)
    finetune(trainer.backbone, nn.Linear(cfg.feat_dim, cfg.num_classes), labelled, cfg, args.device)


if __name__ == "__main__":
    main()
