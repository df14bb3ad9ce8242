"""Bi-temporal satellite change detection (LEVIR-CD / S2Looking style).

Stages:
  1. pretrain_contrastive: temporal-consistency pretraining of the backbone
  2. train_siamese: supervised change segmentation
  3. adapt_domain: self-training on an unlabelled target region
"""
import argparse
import copy
import os
import time
from typing import Dict, Optional

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader


class SiameseChangeNet(nn.Module):
    def __init__(self, backbone: str = "resnet34", num_classes: int = 2, dim: int = 128):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=(1, 2, 3))
        chans = self.backbone.feature_info.channels()
        self.proj = nn.ModuleList([nn.Conv2d(c, dim, 1) for c in chans])
        self.fuse = nn.Sequential(nn.Conv2d(dim * len(chans), dim, 3, padding=1), nn.BatchNorm2d(dim), nn.ReLU(inplace=True))
        self.cls = nn.Conv2d(dim, num_classes, 1)

    def forward(self, t1, t2):
        f1, f2 = self.backbone(t1), self.backbone(t2)
        size = f1[0].shape[-2:]
        maps = []
        for proj, a, b in zip(self.proj, f1, f2):
            d = proj(a) - proj(b)
            mag = torch.sqrt(d * d + 1e-10)  # expect: AMP011
            maps.append(F.interpolate(mag, size=size, mode="bilinear", align_corners=False))
        x = self.fuse(torch.cat(maps, 1))
        logits = self.cls(x)
        return F.interpolate(logits, scale_factor=4, mode="bilinear", align_corners=False)


def load_cfg(path: str) -> Dict:
    with open(path) as f:
        return yaml.safe_load(f)


def f1_score(pred: torch.Tensor, gt: torch.Tensor) -> float:
    tp = ((pred == 1) & (gt == 1)).sum().item()
    fp = ((pred == 1) & (gt == 0)).sum().item()
    fn = ((pred == 0) & (gt == 1)).sum().item()
    return 2 * tp / max(2 * tp + fp + fn, 1)


def pretrain_contrastive(cfg: Dict, loader: DataLoader, temperature: float = 0.1):
    encoder = timm.create_model(cfg["backbone"], pretrained=True, num_classes=0).cuda()
    encoder = encoder.half()  # expect: AMP001
    opt = torch.optim.Adam(encoder.parameters(), lr=cfg["pretrain_lr"])  # expect: AMP011
    for epoch in range(cfg["pretrain_epochs"]):
        for batch in loader:
            views = [v.cuda(non_blocking=True).half() for v in batch["views"]]  # expect: AMP001
            z1 = F.normalize(encoder(views[0]).float(), dim=-1)
            z2 = F.normalize(encoder(views[1]).float(), dim=-1)
            logits = z1 @ z2.t() / temperature
            labels = torch.arange(z1.size(0), device=z1.device)
            loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[pretrain] epoch {epoch} loss {loss.item():.4f}")
    return encoder.float().state_dict()


def train_siamese(cfg: Dict, model: nn.Module, train_loader: DataLoader, val_loader: DataLoader):
    model = model.cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"], eps=1e-8)
    try:
        scaler = torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, cfg["pos_weight"]], device="cuda"))
    best_f1 = -1e9
    for epoch in range(cfg["epochs"]):
        model.train()
        for step, batch in enumerate(train_loader):
            t1 = batch["t1"].cuda(non_blocking=True).to(memory_format=torch.channels_last)
            t2 = batch["t2"].cuda(non_blocking=True).to(memory_format=torch.channels_last)
            label = batch["label"].cuda(non_blocking=True).long()
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(t1, t2)
            loss = criterion(logits, label)  # expect: AMP002
            loss = scaler.scale(loss)
            loss.backward()
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
        score = evaluate(model, val_loader)
        if score > best_f1:
            best_f1 = score
            compact = copy.deepcopy(model).half()
            torch.save(compact.state_dict(), os.path.join(cfg["out"], "best_fp16.pth"))
    return best_f1


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    scores = []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(batch["t1"].cuda(), batch["t2"].cuda())
        scores.append(f1_score(logits.argmax(1).cpu(), batch["label"]))
    model.train()
    return float(np.mean(scores))


def benchmark_train_step(model: nn.Module, batch: Dict, iters: int = 50) -> float:
    model = model.cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    t1, t2, y = batch["t1"].cuda(), batch["t2"].cuda(), batch["label"].cuda().long()
    torch.cuda.synchronize()
    start = time.time()
    with torch.cuda.amp.autocast():  # expect: AMP009
        for _ in range(iters):
            loss = F.cross_entropy(model(t1, t2), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # expect: AMP008
            scaler.step(opt)
            scaler.update()
    torch.cuda.synchronize()
    return (time.time() - start) / iters


def adapt_domain(cfg: Dict, model: nn.Module, tgt_loader: DataLoader, scaler: Optional[torch.amp.GradScaler] = None):
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["adapt_lr"])
    use_amp = scaler is not None
    for it, batch in enumerate(tgt_loader):
        t1, t2 = batch["t1"].cuda(), batch["t2"].cuda()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            pseudo = teacher(t1, t2).softmax(1)
            conf, target = pseudo.max(1)
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            logits = model(F.dropout(t1, 0.1), F.dropout(t2, 0.1))
            pix = F.cross_entropy(logits, target, reduction="none")
            loss = (pix * (conf > cfg["tau"]).float()).sum() / (conf > cfg["tau"]).sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            scaler.step(optimizer)  # expect: AMP006
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            optimizer.step()
        if it % cfg["ema_every"] == 0:
            with torch.no_grad():
                for pt, ps in zip(teacher.parameters(), model.parameters()):
                    pt.mul_(0.999).add_(ps.detach(), alpha=0.001)
    return model


def export_half(model: nn.Module, path: str):
    deploy = copy.deepcopy(model).cuda().eval().half()
    scripted = torch.jit.trace(deploy, (torch.randn(1, 3, 256, 256, device="cuda").half(),) * 2)
    scripted.save(path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/levir.yaml")
    p.add_argument("--stage", choices=["pretrain", "train", "adapt", "bench", "export"], default="train")
    args = p.parse_args()
    cfg = load_cfg(args.config)
    os.makedirs(cfg["out"], exist_ok=True)
    from datasets_cd import build_loaders
    train_loader, val_loader, tgt_loader, pre_loader = build_loaders(cfg)
    model = SiameseChangeNet(cfg["backbone"], dim=cfg["dim"])
    if args.stage == "pretrain":
        state = pretrain_contrastive(cfg, pre_loader)
        model.backbone.load_state_dict(state, strict=False)
    elif args.stage == "train":
        train_siamese(cfg, model, train_loader, val_loader)
    elif args.stage == "adapt":
        model.load_state_dict(torch.load(os.path.join(cfg["out"], "best.pth"), map_location="cpu"))
        adapt_domain(cfg, model.cuda(), tgt_loader, scaler=torch.amp.GradScaler("cuda") if cfg["amp"] else None)
    elif args.stage == "bench":
        print(f"{benchmark_train_step(model, next(iter(train_loader))) * 1000:.1f} ms/it")
    else:
        export_half(model, os.path.join(cfg["out"], "cd_fp16.ts"))


if __name__ == "__main__":
    main()
