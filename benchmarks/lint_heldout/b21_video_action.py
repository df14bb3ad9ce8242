"""Action recognition on a Kinetics-style frame-folder dataset.

(2+1)D conv trunk -> per-frame tokens -> attention + average temporal pooling.
Clips are sampled uniformly (train: random window, val: centre window);
mixup/cutmix with soft targets, trained with a BCE objective as in recent
video recipes.
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

CFG = dict(
    num_frames=16, stride=4, crop=160, num_classes=174, epochs=60, batch_size=16, lr=0.1,
    momentum=0.9, weight_decay=5e-4, mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=0.8,
    smoothing=0.1, clip_grad=1.0, amp=True, fp16_weights=False, width=64,
)
MEAN = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)


def sample_clip_indices(num_available, num_frames, stride, train):
    span = (num_frames - 1) * stride + 1
    if num_available >= span:
        start = random.randint(0, num_available - span) if train else (num_available - span) // 2
        idx = np.arange(start, start + span, stride)
    else:
        idx = np.linspace(0, num_available - 1, num_frames).round().astype(int)
    return idx


class FrameFolderVideos(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, f"{split}.json")) as f:
            self.items = json.load(f)
        self.root, self.train = root, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        folder = os.path.join(self.root, "frames", item["id"])
        frames = sorted(os.listdir(folder))
        idx = sample_clip_indices(len(frames), CFG["num_frames"], CFG["stride"], self.train)
        imgs = [np.asarray(Image.open(os.path.join(folder, frames[j])).convert("RGB")) for j in idx]
        clip = torch.from_numpy(np.stack(imgs)).permute(3, 0, 1, 2).float() / 255.0
        c = CFG["crop"]
        h, w = clip.shape[-2:]
        y0 = random.randint(0, h - c) if self.train else (h - c) // 2
        x0 = random.randint(0, w - c) if self.train else (w - c) // 2
        clip = clip[..., y0:y0 + c, x0:x0 + c]
        if self.train and random.random() < 0.5 and not item.get("direction_sensitive", False):
            clip = clip.flip(-1)
        return (clip - MEAN) / STD, item["label"]


def mix_batch(clips, labels, num_classes):
    targets = F.one_hot(labels, num_classes).float()
    targets = targets * (1 - CFG["smoothing"]) + CFG["smoothing"] / num_classes
    if random.random() > CFG["mix_prob"]:
        return clips, targets
    perm = torch.randperm(clips.size(0), device=clips.device)
    if random.random() < 0.5:
        lam = float(np.random.beta(CFG["mixup_alpha"], CFG["mixup_alpha"]))
        clips = lam * clips + (1 - lam) * clips[perm]
    else:
        lam = float(np.random.beta(CFG["cutmix_alpha"], CFG["cutmix_alpha"]))
        h, w = clips.shape[-2:]
        ch, cw = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
        cy, cx = random.randint(0, h - ch), random.randint(0, w - cw)
        clips = clips.clone()
        clips[..., cy:cy + ch, cx:cx + cw] = clips[perm][..., cy:cy + ch, cx:cx + cw]
        lam = 1 - (ch * cw) / (h * w)
    return clips, lam * targets + (1 - lam) * targets[perm]


class Conv2Plus1D(nn.Sequential):
    def __init__(self, c_in, c_out, stride=1):
        mid = (c_in * c_out * 27) // (c_in * 9 + 3 * c_out)
        super().__init__(
            nn.Conv3d(c_in, mid, (1, 3, 3), (1, stride, stride), (0, 1, 1), bias=False),
            nn.BatchNorm3d(mid), nn.ReLU(inplace=True),
            nn.Conv3d(mid, c_out, (3, 1, 1), (stride, 1, 1), (1, 0, 0), bias=False),
            nn.BatchNorm3d(c_out), nn.ReLU(inplace=True),
        )


class TemporalAttnPool(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, feats, valid):
        scores = self.score(feats).squeeze(-1)
        scores[~valid] = -1e9  # expect: AMP007
        w = scores.softmax(dim=-1)
        attn_pooled = (w.unsqueeze(-1) * feats).sum(dim=1)
        avg_pooled = feats.mean(dim=1)  # expect: AMP004
        return torch.cat([attn_pooled, avg_pooled], dim=-1)


class R2Plus1DNet(nn.Module):
    def __init__(self, num_classes, width=64):
        super().__init__()
        w = width
        self.stem = Conv2Plus1D(3, w, stride=1)
        self.layers = nn.Sequential(Conv2Plus1D(w, 2 * w, 2), Conv2Plus1D(2 * w, 4 * w, 2), Conv2Plus1D(4 * w, 8 * w, 1))
        self.spatial_pool = nn.AdaptiveAvgPool3d((None, 1, 1))
        self.frame_proj = nn.Linear(8 * w, 512)
        self.pool = TemporalAttnPool(512)
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(1024, num_classes)

    def forward(self, clips, valid=None):
        x = self.layers(self.stem(clips))
        x = self.spatial_pool(x).flatten(2).transpose(1, 2)
        feats = self.frame_proj(x)
        if valid is None:
            valid = torch.ones(feats.shape[:2], dtype=torch.bool, device=feats.device)
        return self.head(self.dropout(self.pool(feats, valid)))


def soft_target_bce(logits, targets):
    probs = torch.sigmoid(logits)
    return F.binary_cross_entropy(probs, targets)  # expect: AMP003


def build_model(cfg):
    model = R2Plus1DNet(cfg["num_classes"], cfg["width"])
    if cfg.get("init"):
        model.load_state_dict(torch.load(cfg["init"], map_location="cpu"), strict=False)
    model = model.to(memory_format=torch.channels_last_3d)
    if cfg["fp16_weights"]:
        model = model.half()  # expect: AMP001
    return model


def train(cfg, train_loader, val_loader, out_dir):
    device = torch.device("cuda")
    model = build_model(cfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": cfg["weight_decay"]},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg["lr"], momentum=cfg["momentum"], nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["epochs"] * len(train_loader))
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["amp"])  # expect: AMP009
    best_top1 = 0.0
    for epoch in range(cfg["epochs"]):
        model.train()
        for it, (clips, labels) in enumerate(train_loader):
            clips = clips.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last_3d)
            labels = labels.to(device, non_blocking=True)
            clips, targets = mix_batch(clips, labels, cfg["num_classes"])
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                logits = model(clips)
                loss = soft_target_bce(logits, targets)
                scaler.scale(loss).backward()  # expect: AMP008
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip_grad"])  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f} scale {scaler.get_scale():.0f}")
        top1, top5 = validate(model, val_loader, device)
        print(f"epoch {epoch} top1 {top1:.4f} top5 {top5:.4f}")
        if top1 > best_top1:
            best_top1 = top1
            torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(out_dir, "best.pth"))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    top1 = top5 = n = 0
    for clips, labels in loader:
        clips, labels = clips.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(clips)
        pred5 = logits.float().topk(5, dim=-1).indices
        top1 += (pred5[:, 0] == labels).sum().item()
        top5 += (pred5 == labels[:, None]).any(dim=-1).sum().item()
        n += labels.numel()
    return top1 / n, top5 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/r2p1d")
    ap.add_argument("--fp16-weights", action="store_true")
    args = ap.parse_args()
    cfg = dict(CFG, fp16_weights=args.fp16_weights)
    os.makedirs(args.out, exist_ok=True)
    train_loader = DataLoader(FrameFolderVideos(args.root, "train", True), batch_size=cfg["batch_size"],
                              shuffle=True, num_workers=12, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(FrameFolderVideos(args.root, "validation", False), batch_size=cfg["batch_size"],
                            num_workers=12)
    train(cfg, train_loader, val_loader, args.out)


if __name__ == "__main__":
    main()
