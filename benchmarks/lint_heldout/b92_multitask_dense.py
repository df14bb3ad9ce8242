"""Joint semantic segmentation + depth + boundary training on NYUv2-style data.

Shared ResNet-34 encoder, three light decoders. Loss weights come from the config
and were tuned by hand on the val split.
"""
import argparse
import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader

from data.nyu import NYUMultiTask  # local dataset wrapper


@dataclass
class TrainConfig:
    data_root: str = "/data/nyuv2"
    num_classes: int = 40
    epochs: int = 60
    batch_size: int = 8
    accum_steps: int = 2
    lr: float = 3e-4
    weight_decay: float = 1e-4
    clip_norm: float = 5.0
    loss_weights: dict = field(default_factory=lambda: {"seg": 1.0, "depth": 2.0, "edge": 0.5})
    out_dir: str = "runs/mtl"


class Decoder(nn.Module):
    def __init__(self, in_ch, out_ch):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(in_ch, 256, 3, padding=1, bias=False),
            nn.BatchNorm2d(256),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 128, 3, padding=1, bias=False),
            nn.BatchNorm2d(128),
            nn.ReLU(inplace=True),
            nn.Conv2d(128, out_ch, 1),
        )

    def forward(self, x, size):
        return F.interpolate(self.block(x), size=size, mode="bilinear", align_corners=False)


class MultiTaskNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        backbone = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.encoder = nn.Sequential(*list(backbone.children())[:-2])
        self.seg_head = Decoder(512, num_classes)
        self.depth_head = Decoder(512, 1)
        self.edge_head = Decoder(512, 1)

    def forward(self, x):
        feats = self.encoder(x)
        size = x.shape[-2:]
        return {
            "seg": self.seg_head(feats, size),
            "depth": self.depth_head(feats, size),
            "edge": self.edge_head(feats, size),
        }


def depth_l1(pred, gt):
    valid = gt > 0
    return (pred.squeeze(1)[valid] - gt[valid]).abs().float().mean()


def train(cfg: TrainConfig):
    device = torch.device("cuda")
    train_set = NYUMultiTask(cfg.data_root, split="train")
    val_set = NYUMultiTask(cfg.data_root, split="val")
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=6, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, num_workers=4)

    model = MultiTaskNet(cfg.num_classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    w = cfg.loss_weights

    for epoch in range(cfg.epochs):
        model.train()
        meters = {"seg": 0.0, "depth": 0.0, "edge": 0.0}
        optimizer.zero_grad(set_to_none=True)
        for it, batch in enumerate(train_loader):
            img = batch["image"].to(device, non_blocking=True)
            seg_gt = batch["seg"].to(device, non_blocking=True)
            depth_gt = batch["depth"].to(device, non_blocking=True)
            edge_gt = batch["edge"].to(device, non_blocking=True).float()

            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                out = model(img)
                seg_loss = F.cross_entropy(out["seg"], seg_gt, ignore_index=255)
                depth_loss = depth_l1(out["depth"], depth_gt)
                edge_prob = torch.sigmoid(out["edge"]).squeeze(1)
                edge_loss = F.binary_cross_entropy(edge_prob, edge_gt)  # expect: AMP003
                total = w["seg"] * seg_loss + w["depth"] * depth_loss + w["edge"] * edge_loss
                total = total / cfg.accum_steps

            scaled = scaler.scale(total)
            scaled.backward()

            if (it + 1) % cfg.accum_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)  # expect: AMP005
                optimizer.step()  # expect: AMP006
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

            meters["seg"] += seg_loss.item()
            meters["depth"] += depth_loss.item()
            meters["edge"] += edge_loss.item()

        sched.step()
        n = len(train_loader)
        print(f"epoch {epoch}: " + " ".join(f"{k}={v / n:.4f}" for k, v in meters.items()))
        miou = validate(model, val_loader, cfg.num_classes, device)
        print(f"  val mIoU {miou:.4f}")
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(cfg.out_dir, "last.pth"))


@torch.inference_mode()
def validate(model, loader, num_classes, device):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for batch in loader:
        img = batch["image"].to(device)
        gt = batch["seg"].to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            pred = model(img)["seg"].argmax(1)
        keep = gt != 255
        hist += torch.bincount(num_classes * gt[keep] + pred[keep], minlength=num_classes ** 2).view(
            num_classes, num_classes)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    return iou.mean().item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    cfg = TrainConfig()
    if args.config:
        with open(args.config) as f:
            cfg = TrainConfig(**json.load(f))
    train(cfg)
