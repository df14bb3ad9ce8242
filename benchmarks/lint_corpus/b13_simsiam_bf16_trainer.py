"""SimSiam pretraining on ImageNet-100 with a kNN monitor.

Trainer-class layout with a dataclass config; precision picked from a string.
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


@dataclass
class SimSiamConfig:
    arch: str = "resnet50"
    dim: int = 2048
    pred_dim: int = 512
    batch_size: int = 256
    epochs: int = 200
    base_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    precision: str = "bf16"
    knn_k: int = 200
    knn_t: float = 0.1
    log_every: int = 50
    out_dir: str = "runs/simsiam"
    fix_pred_lr: bool = True
    extra: dict = field(default_factory=dict)


class SimSiam(nn.Module):
    def __init__(self, cfg: SimSiamConfig):
        super().__init__()
        backbone = getattr(torchvision.models, cfg.arch)(zero_init_residual=True)
        prev_dim = backbone.fc.weight.shape[1]
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.projector = nn.Sequential(
            nn.Linear(prev_dim, prev_dim, bias=False), nn.BatchNorm1d(prev_dim), nn.ReLU(inplace=True),
            nn.Linear(prev_dim, prev_dim, bias=False), nn.BatchNorm1d(prev_dim), nn.ReLU(inplace=True),
            nn.Linear(prev_dim, cfg.dim, bias=False), nn.BatchNorm1d(cfg.dim, affine=False),
        )
        self.predictor = nn.Sequential(
            nn.Linear(cfg.dim, cfg.pred_dim, bias=False), nn.BatchNorm1d(cfg.pred_dim), nn.ReLU(inplace=True),
            nn.Linear(cfg.pred_dim, cfg.dim),
        )

    def forward(self, x1, x2):
        z1 = self.projector(self.backbone(x1))
        z2 = self.projector(self.backbone(x2))
        p1, p2 = self.predictor(z1), self.predictor(z2)
        return {"p1": p1, "p2": p2, "z1": z1.detach(), "z2": z2.detach()}


def negative_cosine(p, z):
    return -F.cosine_similarity(p.float(), z.float(), dim=-1).mean()


def autocast_for(precision: str):
    if precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


class SimSiamTrainer:
    def __init__(self, cfg: SimSiamConfig, train_loader, memory_loader, test_loader):
        self.cfg = cfg
        self.device = torch.device("cuda")
        self.model = SimSiam(cfg).to(self.device)
        self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model) if cfg.extra.get("sync_bn") else self.model
        self.train_loader, self.memory_loader, self.test_loader = train_loader, memory_loader, test_loader
        self.init_lr = cfg.base_lr * cfg.batch_size / 256
        if cfg.fix_pred_lr:
            params = [
                {"params": self.model.backbone.parameters(), "fix_lr": False},
                {"params": self.model.projector.parameters(), "fix_lr": False},
                {"params": self.model.predictor.parameters(), "fix_lr": True},
            ]
        else:
            params = self.model.parameters()
        self.optimizer = torch.optim.SGD(params, self.init_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        self.global_step = 0

    def adjust_lr(self, epoch):
        cur_lr = self.init_lr * 0.5 * (1.0 + math.cos(math.pi * epoch / self.cfg.epochs))
        for g in self.optimizer.param_groups:
            g["lr"] = self.init_lr if g.get("fix_lr") else cur_lr

    def training_step(self, images):
        x1 = images[0].to(self.device, non_blocking=True)
        x2 = images[1].to(self.device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = self.model(x1, x2)
            loss = 0.5 * (negative_cosine(out["p1"], out["z2"]) + negative_cosine(out["p2"], out["z1"]))
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()  # expect: AMP008
        self.scaler.step(self.optimizer)
        self.scaler.update()
        with torch.no_grad():
            p_std = out["p1"].std(dim=0).mean()  # expect: AMP004
            z_std = F.normalize(out["z1"].float(), dim=1).std(dim=0).mean()
        return loss.detach(), p_std, z_std

    def train_epoch(self, epoch):
        self.model.train()
        self.adjust_lr(epoch)
        for i, (images, _) in enumerate(self.train_loader):
            loss, p_std, z_std = self.training_step(images)
            self.global_step += 1
            if i % self.cfg.log_every == 0:
                # z_std should stay close to 1/sqrt(dim); a collapse sends it to 0
                print(f"[{epoch}][{i}] loss {loss.item():.4f} p_std {p_std.item():.4f} "
                      f"z_std {z_std.item() * math.sqrt(self.cfg.dim):.3f}")

    @torch.no_grad()
    def knn_monitor(self):
        self.model.eval()
        feats, labels = [], []
        with autocast_for(self.cfg.precision):
            for x, y in self.memory_loader:
                f = self.model.backbone(x.to(self.device, non_blocking=True))
                feats.append(F.normalize(f.float(), dim=1))
                labels.append(y.to(self.device))
        bank = torch.cat(feats).t().contiguous().half()
        bank_labels = torch.cat(labels)
        n_cls = int(bank_labels.max()) + 1
        correct, total = 0, 0
        for x, y in self.test_loader:
            y = y.to(self.device)
            f = F.normalize(self.model.backbone(x.to(self.device)).float(), dim=1).half()
            sim = f @ bank
            w, idx = sim.topk(self.cfg.knn_k, dim=-1)
            nl = torch.gather(bank_labels.expand(f.size(0), -1), -1, idx)
            w = (w.float() / self.cfg.knn_t).exp()
            one_hot = torch.zeros(f.size(0) * self.cfg.knn_k, n_cls, device=self.device)
            one_hot.scatter_(1, nl.view(-1, 1), 1.0)
            scores = (one_hot.view(f.size(0), -1, n_cls) * w.unsqueeze(-1)).sum(1)
            correct += (scores.argmax(-1) == y).sum().item()
            total += y.numel()
        self.model.train()
        return 100.0 * correct / total

    def save(self, epoch, acc):
        os.makedirs(self.cfg.out_dir, exist_ok=True)
        torch.save({"epoch": epoch, "arch": self.cfg.arch, "state_dict": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "knn_acc": acc},
                   os.path.join(self.cfg.out_dir, f"checkpoint_{epoch:04d}.pth.tar"))

    def fit(self):
        best = 0.0
        for epoch in range(self.cfg.epochs):
            self.train_epoch(epoch)
            acc = self.knn_monitor()
            best = max(best, acc)
            print(f"epoch {epoch}: kNN acc {acc:.2f} (best {best:.2f})")
            if epoch % 10 == 0 or epoch == self.cfg.epochs - 1:
                self.save(epoch, acc)


if __name__ == "__main__":
    from torch.utils.data import DataLoader, TensorDataset

    cfg = SimSiamConfig(epochs=2, batch_size=8, arch="resnet18", dim=512, pred_dim=128)
    views = TensorDataset(torch.randn(32, 2, 3, 64, 64), torch.randint(0, 10, (32,)))
    train = DataLoader(views, batch_size=8, collate_fn=lambda b: ((torch.stack([v[0][0] for v in b]),
                                                                 torch.stack([v[0][1] for v in b])),
                                                                torch.stack([v[1] for v in b])))
    mem = DataLoader(TensorDataset(torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))), batch_size=8)
    SimSiamTrainer(cfg, train, mem, mem).fit()
