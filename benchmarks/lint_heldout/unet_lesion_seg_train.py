"""2D U-Net with deep supervision for skin-lesion segmentation (ISIC 2018 task 1)."""
import argparse
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from datasets.isic import LesionDataset  # project-local
from models.unet import UNetDeepSup  # project-local

EPS = 1e-8


def parse_args():
    parser = argparse.ArgumentParser(description="ISIC lesion segmentation")
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--aux-weight", type=float, default=0.4)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast")
    parser.add_argument("--out", default="checkpoints")
    return parser.parse_args()


def dice_coefficient(probs, target):
    inter = (probs * target).sum(dim=(1, 2, 3))
    denom = probs.sum(dim=(1, 2, 3)) + target.sum(dim=(1, 2, 3))
    return (2 * inter + EPS) / (denom + EPS)


def dice_bce_loss(probs, target, bce_weight=0.5):
    bce = F.binary_cross_entropy(probs, target)  # expect: AMP003
    dice = 1.0 - dice_coefficient(probs, target).mean()
    return bce_weight * bce + (1.0 - bce_weight) * dice


def train_one_epoch(model, loader, optimizer, amp_ctx, device, aux_weight):
    model.train()
    running = 0.0
    for images, masks in loader:
        images = images.to(device, non_blocking=True).half()  # expect: AMP001
        masks = masks.to(device, non_blocking=True).float()
        with amp_ctx:
            logits, aux_logits = model(images)
            loss = dice_bce_loss(torch.sigmoid(logits), masks)
        loss = loss + aux_weight * sum(F.binary_cross_entropy_with_logits(a, F.interpolate(masks, size=a.shape[-2:], mode="nearest")) for a in aux_logits)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running += loss.item()
    return running / len(loader)


@torch.no_grad()
def validate(model, loader, amp_ctx, device):
    model.eval()
    dices, bces = [], []
    for images, masks in loader:
        images, masks = images.to(device), masks.to(device).float()
        with amp_ctx:
            logits, _ = model(images)
            probs = torch.sigmoid(logits)
            bces.append(F.binary_cross_entropy(probs, masks).item())  # expect: AMP003
        dices.append(dice_coefficient((probs.float() > 0.5).float(), masks).mean().item())
    return float(np.mean(dices)), float(np.mean(bces))


def main():
    args = parse_args()
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    train_ds = LesionDataset(args.data_root, split="train", size=256, augment=True)
    val_ds = LesionDataset(args.data_root, split="val", size=256, augment=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4)

    model = UNetDeepSup(in_channels=3, out_channels=1, base=32).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010

    best_dice = 0.0
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, train_loader, optimizer, amp_ctx, device, args.aux_weight)
        val_dice, val_bce = validate(model, val_loader, amp_ctx, device)
        scheduler.step()
        print(f"epoch {epoch:03d} train {train_loss:.4f} val_dice {val_dice:.4f} val_bce {val_bce:.4f}")
        if val_dice > best_dice:
            best_dice = val_dice
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
