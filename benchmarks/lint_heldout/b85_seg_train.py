"""Binary segmentation (building footprints) with a light U-Net.

    python seg_train.py --data /data/footprints --epochs 60 --grad-checkpointing
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from footprint_data import FootprintDataset


class ConvBNAct(nn.Sequential):
    def __init__(self, cin, cout, k=3):
        super().__init__(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.SiLU(inplace=True))


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        s = torch.sigmoid(self.fc2(F.silu(self.fc1(s))))
        return x * s


class Block(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(ConvBNAct(cin, cout), ConvBNAct(cout, cout), SqueezeExcite(cout))


class UNetLite(nn.Module):
    def __init__(self, in_ch=3, base=32, depth=4, grad_checkpointing=False):
        super().__init__()
        self.grad_checkpointing = grad_checkpointing
        chs = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([Block(in_ch if i == 0 else chs[i - 1], chs[i]) for i in range(depth)])
        self.bottleneck = Block(chs[depth - 1], chs[depth])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, stride=2) for i in reversed(range(depth))])
        self.up_blocks = nn.ModuleList([Block(2 * chs[i], chs[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(base, 1, 1)

    def forward(self, x):
        skips = []
        for block in self.down:
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, block, skip in zip(self.ups, self.up_blocks, reversed(skips)):
            x = block(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def dice_bce_loss(logits, target, bce_weight=0.5, smooth=1.0):
    probs = torch.sigmoid(logits.float())
    target = target.float()
    bce = F.binary_cross_entropy(probs, target)  # expect: AMP003
    inter = (probs * target).sum(dim=(2, 3))
    union = probs.sum(dim=(2, 3)) + target.sum(dim=(2, 3))
    dice = 1.0 - (2.0 * inter + smooth) / (union + smooth)
    return bce_weight * bce + (1.0 - bce_weight) * dice.mean()


def train_one_epoch(model, loader, optimizer, scheduler, device, epoch, bce_weight=0.5, log_every=50):
    model.train()
    running = 0.0
    for step, (images, masks) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        masks = masks.to(device, non_blocking=True).unsqueeze(1)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            logits = model(images)
            loss = dice_bce_loss(logits, masks, bce_weight=bce_weight)
        loss.backward()
        optimizer.step()
        scheduler.step()
        running += loss.item()
        if (step + 1) % log_every == 0:
            print(f"epoch {epoch} step {step + 1}/{len(loader)} loss {running / log_every:.4f}")
            running = 0.0


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    total_loss, inter, union = 0.0, 0, 0
    for images, masks in loader:
        images = images.to(device, non_blocking=True)
        masks = masks.to(device, non_blocking=True).unsqueeze(1)
        with torch.cuda.amp.autocast():  # expect: AMP009
            logits = model(images)
            total_loss += dice_bce_loss(logits, masks).item()
        preds = logits > 0
        target = masks.bool()
        inter += (preds & target).sum().item()
        union += (preds | target).sum().item()
    return total_loss / len(loader), inter / max(union, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/footprints")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--bce-weight", type=float, default=0.5)
    p.add_argument("--base-width", type=int, default=32)
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--fp16-weights", action="store_true", help="keep the network weights in half precision")
    p.add_argument("--resume", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    train_ds = FootprintDataset(args.data, split="train", augment=True)
    val_ds = FootprintDataset(args.data, split="val", augment=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    model = UNetLite(base=args.base_width, grad_checkpointing=args.grad_checkpointing).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.fp16_weights:
        model = model.half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader))

    start_epoch, best_iou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_iou = ckpt["epoch"] + 1, ckpt["best_iou"]

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, train_loader, optimizer, scheduler, device, epoch, bce_weight=args.bce_weight)
        val_loss, iou = validate(model, val_loader, device)
        print(f"epoch {epoch}: val_loss {val_loss:.4f} iou {iou:.4f}")
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "epoch": epoch, "best_iou": max(best_iou, iou)}
        torch.save(state, os.path.join(args.out, "last.pt"))
        if iou > best_iou:
            best_iou = iou
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
