"""Binary lesion segmentation on 2D slices: U-Net with deep supervision and
hand-written Dice / focal losses, flip TTA with an entropy map at test time.

Expected layout: ROOT/{train,val,test}/{images,masks}/*.npy
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class SliceDataset(Dataset):
    def __init__(self, root, split, augment=False):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.npy")))
        self.augment = augment

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = np.load(self.images[i]).astype(np.float32)
        mask = np.load(self.images[i].replace("images", "masks")).astype(np.float32)
        img = (img - img.mean()) / (img.std() + 1e-6)
        if self.augment and random.random() < 0.5:
            img, mask = img[:, ::-1].copy(), mask[:, ::-1].copy()
        return torch.from_numpy(img)[None], torch.from_numpy(mask)[None]


class DoubleConv(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    def __init__(self, in_ch=1, base=32, deep_supervision=True):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8]
        self.downs = nn.ModuleList()
        c = in_ch
        for ch in chs:
            self.downs.append(DoubleConv(c, ch))
            c = ch
        self.bottleneck = DoubleConv(chs[-1], chs[-1] * 2)
        self.ups, self.up_convs = nn.ModuleList(), nn.ModuleList()
        c = chs[-1] * 2
        for ch in reversed(chs):
            self.ups.append(nn.ConvTranspose2d(c, ch, 2, stride=2))
            self.up_convs.append(DoubleConv(2 * ch, ch))
            c = ch
        self.head = nn.Conv2d(base, 1, 1)
        self.aux_head = nn.Conv2d(chs[-1], 1, 1) if deep_supervision else None

    def forward(self, x):
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        aux = None
        for i, (up, conv) in enumerate(zip(self.ups, self.up_convs)):
            x = conv(torch.cat([up(x), skips[-(i + 1)]], dim=1))
            if i == 0 and self.aux_head is not None:
                aux = self.aux_head(x)
        out = self.head(x)
        if self.training and aux is not None:
            return out, aux
        return out


class SoftDiceLoss(nn.Module):
    def __init__(self, smooth=1.0):
        super().__init__()
        self.smooth = smooth

    def forward(self, logits, targets):
        probs = torch.sigmoid(logits.float())
        dims = (1, 2, 3)
        inter = (probs * targets).sum(dims)
        denom = probs.sum(dims) + targets.sum(dims)
        dice = (2.0 * inter + self.smooth) / (denom + self.smooth)
        return 1.0 - dice.mean()


class FocalLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0):
        super().__init__()
        self.alpha, self.gamma = alpha, gamma

    def forward(self, logits, targets):
        bce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        p = torch.sigmoid(logits)
        p_t = p * targets + (1 - p) * (1 - targets)
        a_t = self.alpha * targets + (1 - self.alpha) * (1 - targets)
        return (a_t * (1 - p_t) ** self.gamma * bce).mean()


class Trainer:
    def __init__(self, model, args, device):
        self.model, self.args, self.device = model, args, device
        self.criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([args.pos_weight], device=device))
        self.dice = SoftDiceLoss()
        self.focal = FocalLoss(gamma=args.gamma)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=args.epochs)
        try:
            self.scaler = torch.amp.GradScaler("cuda")
        except (AttributeError, TypeError):
            self.scaler = torch.cuda.amp.GradScaler()

    def train_step(self, images, masks):
        images = images.to(self.device, non_blocking=True)
        masks = masks.to(self.device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits, aux_logits = self.model(images)
            loss_dice = self.dice(logits, masks)
            loss_focal = self.focal(logits, masks)
            small = F.interpolate(masks, size=aux_logits.shape[-2:], mode="nearest")
            loss_aux = F.binary_cross_entropy(torch.sigmoid(aux_logits), small)  # expect: AMP003
        loss_bce = self.criterion(logits, masks)  # expect: AMP002
        loss = (loss_bce + self.args.dice_weight * loss_dice
                + self.args.focal_weight * loss_focal + 0.4 * loss_aux)

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    dices = []
    for images, masks in loader:
        images, masks = images.to(device), masks.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(images)
        pred = (logits.float().sigmoid() > 0.5).float()
        inter = (pred * masks).sum((1, 2, 3))
        dice = (2 * inter + 1e-6) / (pred.sum((1, 2, 3)) + masks.sum((1, 2, 3)) + 1e-6)
        dices.append(dice.cpu())
    model.train()
    return torch.cat(dices).mean().item()


@torch.inference_mode()
def predict_tta(model, image):
    """Flip TTA; returns the binary mask, a per-pixel entropy map and the foreground fraction."""
    model.eval()
    views = ((), (-1,), (-2,), (-2, -1))
    acc = torch.zeros_like(image[:, :1], dtype=torch.float16)
    for dims in views:
        x = image.flip(dims) if dims else image
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(x)
        probs = torch.sigmoid(logits)
        acc += probs.flip(dims) if dims else probs
    acc.div_(len(views))
    fg_fraction = acc.mean(dim=(1, 2, 3))
    entropy = -(acc * torch.log(acc + 1e-8) + (1 - acc) * torch.log(1 - acc + 1e-8))  # expect: AMP011
    return acc > 0.5, entropy.float(), fg_fraction.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--base", type=int, default=32)
    ap.add_argument("--pos-weight", type=float, default=3.0)
    ap.add_argument("--gamma", type=float, default=2.0)
    ap.add_argument("--dice-weight", type=float, default=1.0)
    ap.add_argument("--focal-weight", type=float, default=0.5)
    ap.add_argument("--clip", type=float, default=12.0)
    ap.add_argument("--out", default="runs/unet")
    args = ap.parse_args()

    device = torch.device("cuda")
    train_ds = SliceDataset(args.root, "train", augment=True)
    val_ds = SliceDataset(args.root, "val")
    train_loader = DataLoader(train_ds, args.batch_size, shuffle=True, num_workers=6, drop_last=True)
    val_loader = DataLoader(val_ds, args.batch_size, shuffle=False, num_workers=4)

    model = UNet(in_ch=1, base=args.base).to(device)
    trainer = Trainer(model, args, device)
    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        running = 0.0
        for images, masks in train_loader:
            running += trainer.train_step(images, masks).item()
        trainer.scheduler.step()
        dice = validate(model, val_loader, device)
        print(f"epoch {epoch:3d} loss {running / len(train_loader):.4f} val dice {dice:.4f}")
        if dice > best:
            best = dice
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
