"""U-Net training for multi-class semantic segmentation (Cityscapes-style labels,
255 = ignore). Optional second stage at full resolution with a small batch.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from datasets_seg import SegmentationFolder, train_transforms, val_transforms


class MemoryEfficientSwish(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad_out * (s * (1 + x * (1 - s)))


class Swish(nn.Module):
    def forward(self, x):
        return MemoryEfficientSwish.apply(x)


def conv_block(c_in, c_out):
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), Swish(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), Swish(),
    )


class UNet(nn.Module):
    def __init__(self, n_classes, base=32, depth=4):
        super().__init__()
        chans = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([conv_block(3, chans[0])] + [conv_block(chans[i], chans[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(depth))])
        self.dec = nn.ModuleList([conv_block(2 * chans[i], chans[i]) for i in reversed(range(depth))])
        self.classifier = nn.Conv2d(chans[0], n_classes, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.classifier(x)


class DiceCELoss(nn.Module):
    def __init__(self, n_classes, dice_weight=1.0, ce_weight=1.0, smooth=1.0, ignore_index=255):
        super().__init__()
        self.n_classes, self.ignore_index = n_classes, ignore_index
        self.dice_weight, self.ce_weight, self.smooth = dice_weight, ce_weight, smooth

    def forward(self, logits, target):
        ce = F.cross_entropy(logits, target, ignore_index=self.ignore_index)
        valid = (target != self.ignore_index).unsqueeze(1)
        probs = logits.softmax(dim=1) * valid
        onehot = F.one_hot(target.clamp(max=self.n_classes - 1), self.n_classes).permute(0, 3, 1, 2)
        onehot = onehot.to(probs.dtype) * valid
        inter = (probs * onehot).sum(dim=(0, 2, 3))
        denom = probs.sum(dim=(0, 2, 3)) + onehot.sum(dim=(0, 2, 3))
        dice = 1.0 - ((2.0 * inter + self.smooth) / (denom + self.smooth)).mean()
        return self.ce_weight * ce + self.dice_weight * dice


def train_one_epoch(model, loader, criterion, optimizer, scaler, device, args):
    model.train()
    running = 0.0
    for step, (images, masks) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        masks = masks.to(device, non_blocking=True).long()
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
            logits = model(images)
        loss = criterion(logits, masks)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()  # expect: AMP006
        running += loss.item()
        if step % args.print_freq == 0:
            print(f"  step {step:5d}  loss {running / (step + 1):.4f}")
    return running / max(1, len(loader))


@torch.no_grad()
def validate(model, loader, criterion, n_classes, device):
    model.eval()
    confusion = torch.zeros(n_classes, n_classes, dtype=torch.long, device=device)
    total_loss = 0.0
    for images, masks in loader:
        images, masks = images.to(device), masks.to(device).long()
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
        total_loss += criterion(logits.float(), masks).item()
        keep = masks != 255
        idx = masks[keep] * n_classes + logits.argmax(dim=1)[keep]
        confusion += torch.bincount(idx, minlength=n_classes ** 2).view(n_classes, n_classes)
    iou = confusion.diag().double() / (confusion.sum(0) + confusion.sum(1) - confusion.diag()).clamp(min=1).double()
    return total_loss / max(1, len(loader)), iou.mean().item()


def finetune_full_resolution(model, loader, criterion, args, device):
    model = model.type(torch.cuda.HalfTensor)  # expect: AMP001
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * 0.1, momentum=0.9, weight_decay=1e-4)
    param_dtype = next(model.parameters()).dtype
    model.train()
    for images, masks in loader:
        images = images.to(device, dtype=param_dtype, non_blocking=True)
        masks = masks.to(device, non_blocking=True).long()
        loss = criterion(model(images), masks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default=os.environ.get("SEG_DATA", "data/cityscapes"))
    ap.add_argument("--n-classes", type=int, default=19)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=10.0)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--full-res-epochs", type=int, default=0)
    ap.add_argument("--print-freq", type=int, default=50)
    ap.add_argument("--out", default="checkpoints/unet")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    train_set = SegmentationFolder(args.data_root, "train", train_transforms(args.crop))
    val_set = SegmentationFolder(args.data_root, "val", val_transforms())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=2, num_workers=4)

    model = UNet(args.n_classes).to(device)
    criterion = DiceCELoss(args.n_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.epochs, power=0.9)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None

    best_miou = 0.0
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, scaler, device, args)
        scheduler.step()
        val_loss, miou = validate(model, val_loader, criterion, args.n_classes, device)
        print(f"epoch {epoch}: train {train_loss:.4f} val {val_loss:.4f} mIoU {100 * miou:.2f}")
        if miou > best_miou:
            best_miou = miou
            torch.save({"model": model.state_dict(), "epoch": epoch, "miou": miou}, os.path.join(args.out, "best.pt"))

    if args.full_res_epochs:
        full_set = SegmentationFolder(args.data_root, "train", train_transforms(None))
        full_loader = DataLoader(full_set, batch_size=2, shuffle=True, num_workers=8, drop_last=True)
        for _ in range(args.full_res_epochs):
            model = finetune_full_resolution(model, full_loader, criterion, args, device)
        torch.save(model.state_dict(), os.path.join(args.out, "full_res.pt"))


if __name__ == "__main__":
    main()
