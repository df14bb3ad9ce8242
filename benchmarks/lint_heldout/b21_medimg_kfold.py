"""Chest CT slice classifier (5-fold CV, TTA at validation, OOF AUC).

Usage: python train_ct.py --csv folds.csv --img-dir /data/ct_png --epochs 20
"""
import argparse
import copy
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

CFG = {
    "img_size": 384,
    "num_classes": 4,
    "folds": 5,
    "epochs": 20,
    "batch_size": 24,
    "accum_steps": 4,
    "lr": 3e-4,
    "weight_decay": 1e-4,
    "max_norm": 2.0,
    "focal_gamma": 2.0,
    "amp": True,
    "seed": 42,
}


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CTSliceDataset(Dataset):
    def __init__(self, df, img_dir, train=True):
        self.df = df.reset_index(drop=True)
        self.img_dir = img_dir
        size = CFG["img_size"]
        aug = [T.RandomResizedCrop(size, scale=(0.8, 1.0)), T.RandomHorizontalFlip(), T.RandomRotation(10)]
        self.tf = T.Compose((aug if train else [T.Resize(size), T.CenterCrop(size)]) + [T.PILToTensor()])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = Image.open(os.path.join(self.img_dir, row["image_id"] + ".png")).convert("I;16")
        x = self.tf(img).float()
        return x, int(row["label"])


class SqueezeExcite(nn.Module):
    def __init__(self, channels, rd_ratio=0.25):
        super().__init__()
        rd = max(8, int(channels * rd_ratio))
        self.reduce = nn.Conv2d(channels, rd, 1)
        self.expand = nn.Conv2d(rd, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        s = F.silu(self.reduce(s))
        return x * torch.sigmoid(self.expand(s))


class MBConv(nn.Module):
    def __init__(self, c_in, c_out, stride, expand=4):
        super().__init__()
        mid = c_in * expand
        self.pw = nn.Sequential(nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.SiLU())
        self.dw = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid)
        self.se = SqueezeExcite(mid)
        self.project = nn.Sequential(nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.use_res = stride == 1 and c_in == c_out

    def forward(self, x):
        h = F.silu(self.dw(self.pw(x)))
        h = self.se(h)
        h = self.project(h)
        return x + h if self.use_res else h


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return x.clamp(min=self.eps).pow(self.p).mean(dim=(-2, -1)).pow(1.0 / self.p)


class CTNet(nn.Module):
    def __init__(self, num_classes, widths=(32, 48, 96, 160, 256)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, widths[0], 3, 2, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.SiLU())
        blocks = []
        for c_in, c_out in zip(widths[:-1], widths[1:]):
            blocks += [MBConv(c_in, c_out, stride=2), MBConv(c_out, c_out, stride=1)]
        self.blocks = nn.Sequential(*blocks)
        self.pool = GeM()
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(self.drop(self.pool(x)))


class FocalLoss(nn.Module):
    def __init__(self, gamma=2.0, weight=None):
        super().__init__()
        self.gamma = gamma
        self.register_buffer("weight", weight)

    def forward(self, logits, targets):
        ce = F.cross_entropy(logits, targets, weight=self.weight, reduction="none")
        pt = torch.exp(-ce)
        return ((1.0 - pt) ** self.gamma * ce).mean()


def train_one_epoch(model, loader, criterion, optimizer, scheduler, scaler, device):
    model.train()
    running, n = 0.0, 0
    optimizer.zero_grad(set_to_none=True)
    for step, (images, targets) in enumerate(loader):
        images = images.to(device, non_blocking=True).half()  # expect: AMP001
        targets = targets.to(device, non_blocking=True)
        # per-slice standardisation on GPU: raw HU ranges differ between scanners
        images = (images - images.mean(dim=(1, 2, 3), keepdim=True)) / (images.std(dim=(1, 2, 3), keepdim=True) + 1e-8)  # expect: AMP004 AMP011
        with torch.autocast("cuda", dtype=torch.float16, enabled=CFG["amp"]):
            logits = model(images)
        loss = criterion(logits, targets) / CFG["accum_steps"]  # expect: AMP002
        scaler.scale(loss).backward()
        if (step + 1) % CFG["accum_steps"] == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_norm"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        running += loss.item() * CFG["accum_steps"] * images.size(0)
        n += images.size(0)
    if len(loader) % CFG["accum_steps"] != 0:
        # flush the gradients of the last incomplete accumulation window
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
    return running / max(n, 1)


@torch.no_grad()
def tta_predict(model, images):
    views = [images, images.flip(-1), images.flip(-2), images.flip(-1).flip(-2)]
    probs = []
    for v in views:
        with torch.autocast("cuda", dtype=torch.float16, enabled=CFG["amp"]):
            logits = model(v)
        probs.append(torch.softmax(logits.float(), dim=-1))
    return torch.stack(probs).mean(0)


@torch.no_grad()
def validate(model, loader, criterion, device):
    model.eval()
    all_probs, all_targets, losses = [], [], []
    for images, targets in loader:
        images = images.to(device).float()
        images = (images - images.mean(dim=(1, 2, 3), keepdim=True)) / (images.std(dim=(1, 2, 3), keepdim=True) + 1e-6)
        targets = targets.to(device)
        probs = tta_predict(model, images)
        losses.append(F.nll_loss(torch.log(probs.clamp_min(1e-7)), targets).item())
        all_probs.append(probs.cpu().numpy())
        all_targets.append(targets.cpu().numpy())
    probs, targets = np.concatenate(all_probs), np.concatenate(all_targets)
    auc = roc_auc_score(targets, probs, multi_class="ovr")
    return float(np.mean(losses)), auc, probs


def export_torchscript(model, path):
    m = copy.deepcopy(model).eval().half()
    example = torch.randn(1, 1, CFG["img_size"], CFG["img_size"], device="cuda").half()
    torch.jit.trace(m, example).save(path)


def run_fold(fold, df, args, device):
    train_df, valid_df = df[df.fold != fold], df[df.fold == fold]
    train_loader = DataLoader(CTSliceDataset(train_df, args.img_dir, True), batch_size=CFG["batch_size"],
                              shuffle=True, num_workers=8, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(CTSliceDataset(valid_df, args.img_dir, False), batch_size=CFG["batch_size"] * 2,
                              num_workers=8)
    model = CTNet(CFG["num_classes"]).to(device).to(memory_format=torch.channels_last)
    counts = np.bincount(train_df.label, minlength=CFG["num_classes"])
    class_w = torch.tensor(counts.sum() / (len(counts) * counts), dtype=torch.float32, device=device)
    criterion = FocalLoss(CFG["focal_gamma"], weight=class_w)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG["lr"], weight_decay=CFG["weight_decay"])
    total = CFG["epochs"] * len(train_loader) // CFG["accum_steps"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=CFG["lr"], total_steps=total + 1)
    try:
        scaler = torch.amp.GradScaler("cuda", enabled=CFG["amp"])
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler(enabled=CFG["amp"])

    best_auc, best_probs = -1.0, None
    for epoch in range(CFG["epochs"]):
        tr_loss = train_one_epoch(model, train_loader, criterion, optimizer, scheduler, scaler, device)
        va_loss, va_auc, probs = validate(model, valid_loader, criterion, device)
        print(f"fold {fold} ep {epoch:02d} train {tr_loss:.4f} valid {va_loss:.4f} auc {va_auc:.4f}")
        if va_auc > best_auc:
            best_auc, best_probs = va_auc, probs
            torch.save(model.state_dict(), os.path.join(args.out_dir, f"fold{fold}_best.pt"))
    export_torchscript(model, os.path.join(args.out_dir, f"fold{fold}_ts.pt"))
    return valid_df.index.values, best_probs, best_auc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True)
    parser.add_argument("--img-dir", required=True)
    parser.add_argument("--out-dir", default="outputs")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    seed_everything(CFG["seed"])
    device = torch.device("cuda")

    df = pd.read_csv(args.csv)
    skf = StratifiedKFold(n_splits=CFG["folds"], shuffle=True, random_state=CFG["seed"])
    df["fold"] = -1
    for k, (_, va_idx) in enumerate(skf.split(df, df.label)):
        df.loc[va_idx, "fold"] = k

    oof = np.zeros((len(df), CFG["num_classes"]), dtype=np.float32)
    scores = []
    for fold in range(CFG["folds"]):
        idx, probs, auc = run_fold(fold, df, args, device)
        oof[idx] = probs
        scores.append(auc)
    print("fold AUCs", np.round(scores, 4), "mean", np.mean(scores))
    print("OOF AUC", roc_auc_score(df.label.values, oof, multi_class="ovr"))
    np.save(os.path.join(args.out_dir, "oof.npy"), oof)


if __name__ == "__main__":
    main()
