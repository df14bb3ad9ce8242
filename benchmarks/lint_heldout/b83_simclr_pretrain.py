"""SimCLR pre-training with an NT-Xent objective and an offline linear probe.

    torchrun --nproc-per-node 1 simclr_pretrain.py --data /datasets/imagenet100 --amp
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader
from torchvision import transforms as T


class TwoViews:
    def __init__(self, size=96):
        self.tf = T.Compose([
            T.RandomResizedCrop(size, scale=(0.2, 1.0)),
            T.RandomHorizontalFlip(),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            T.RandomGrayscale(p=0.2),
            T.RandomApply([T.GaussianBlur(9, sigma=(0.1, 2.0))], p=0.5),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ])

    def __call__(self, img):
        return [self.tf(img), self.tf(img)]


class SimCLR(nn.Module):
    def __init__(self, arch="resnet18", proj_dim=128, hidden=2048):
        super().__init__()
        backbone = getattr(torchvision.models, arch)(weights=None)
        self.feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.projector = nn.Sequential(
            nn.Linear(self.feat_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, proj_dim),
        )

    def forward(self, x):
        return self.projector(self.backbone(x))


class NTXentLoss(nn.Module):
    def __init__(self, temperature=0.2):
        super().__init__()
        self.temperature = temperature

    def forward(self, z1, z2):
        z1, z2 = z1.float(), z2.float()
        z = F.normalize(torch.cat([z1, z2]), dim=1)
        n = z1.shape[0]
        sim = z @ z.t() / self.temperature
        self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
        sim = sim.masked_fill(self_mask, float("-inf"))
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
        return F.cross_entropy(sim, targets)


def cosine_lr(optimizer, base_lr, step, total, warmup):
    if step < warmup:
        lr = base_lr * (step + 1) / warmup
    else:
        lr = 0.5 * base_lr * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, args, device):
    model.train()
    total = args.epochs * len(loader)
    t0 = time.time()
    for step, (views, _) in enumerate(loader):
        lr = cosine_lr(optimizer, args.lr, epoch * len(loader) + step, total, args.warmup_steps)
        views = tree_map(lambda t: t.to(device=device, dtype=torch.bfloat16, non_blocking=True), views)  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            z1 = model(views[0])
            z2 = model(views[1])
            loss = criterion(z1, z2)
            with torch.no_grad():
                z_std = z1.std(dim=0)  # expect: AMP004
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        if step % args.log_every == 0:
            print(f"ep {epoch} it {step} loss {loss.item():.4f} lr {lr:.3e} "
                  f"gnorm {grad_norm.item():.2f} z-std {z_std.float().mean().item():.4f} "
                  f"({(time.time() - t0) / (step + 1):.3f}s/it)")


def linear_probe(model, train_loader, val_loader, n_classes, device, epochs=20):
    """Train a logistic-regression probe on frozen backbone features."""
    model.eval()

    def extract(loader):
        feats, labels = [], []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in loader:
                feats.append(model.backbone(x.to(device)).float())
                labels.append(y.to(device))
        return torch.cat(feats), torch.cat(labels)

    x_tr, y_tr = extract(train_loader)
    x_va, y_va = extract(val_loader)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_va = (x_tr - mean) / std, (x_va - mean) / std
    probe = nn.Linear(x_tr.shape[1], n_classes).to(device)
    opt = torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(epochs):
        perm = torch.randperm(x_tr.shape[0], device=device)
        for i in range(0, len(perm), 1024):
            idx = perm[i:i + 1024]
            loss = F.cross_entropy(probe(x_tr[idx]), y_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = (probe(x_va).argmax(1) == y_va).float().mean().item()
    model.train()
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--warmup-steps", type=int, default=2000)
    ap.add_argument("--clip", type=float, default=3.0)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--probe-every", type=int, default=25)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--out", default="runs/simclr")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    pretrain = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), transform=TwoViews())
    plain = T.Compose([T.Resize(110), T.CenterCrop(96), T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    probe_train = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), transform=plain)
    probe_val = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), transform=plain)
    loader = DataLoader(pretrain, batch_size=args.batch_size, shuffle=True, num_workers=10, drop_last=True, pin_memory=True)

    model = SimCLR(args.arch).to(device)
    criterion = NTXentLoss(args.temperature)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)  # expect: AMP010

    for epoch in range(args.epochs):
        train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, args, device)
        if (epoch + 1) % args.probe_every == 0:
            acc = linear_probe(model, DataLoader(probe_train, batch_size=512, num_workers=10),
                               DataLoader(probe_val, batch_size=512, num_workers=10),
                               len(probe_train.classes), device)
            print(f"epoch {epoch}: linear probe top-1 {100 * acc:.2f}%")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                   os.path.join(args.out, "last.pt"))

    backbone = copy.deepcopy(model.backbone).half().eval()
    torch.save(backbone.state_dict(), os.path.join(args.out, "backbone_fp16.pt"))


if __name__ == "__main__":
    main()
