"""Residual U-Net with deep supervision for binary lesion segmentation.

Trains on 2D slices exported by ``tools/export_slices.py``.  The decoder emits one
prediction per resolution; during training every prediction is supervised against a
down-sampled copy of the mask (nnU-Net style), at inference only the full-resolution
head is used.  A small image-level head predicts whether the slice contains a lesion
at all, which helps with the many empty slices.
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from seglib.data import LesionSliceDataset, build_transforms
from seglib.utils import AverageMeter, save_checkpoint, seed_everything

logger = logging.getLogger("unet_ds")


# --------------------------------------------------------------------------- model

def conv_bn_act(cin, cout, k=3, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class SqueezeExcite(nn.Module):
    def __init__(self, channels, rd_ratio=0.25):
        super().__init__()
        rd = max(8, int(channels * rd_ratio))
        self.fc1 = nn.Conv2d(channels, rd, 1)
        self.fc2 = nn.Conv2d(rd, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.fc2(F.relu(self.fc1(s), inplace=True))
        return x * torch.sigmoid(s)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride=1, use_se=True):
        super().__init__()
        self.conv1 = conv_bn_act(cin, cout, 3, stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.se = SqueezeExcite(cout) if use_se else nn.Identity()
        self.bn2 = nn.BatchNorm2d(cout)
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
        else:
            self.skip = nn.Identity()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.conv1(x)
        out = self.conv2(out)
        out = self.se(out)
        out = self.bn2(out)
        return self.act(out + self.skip(x))


def _make_stage(cin, cout, blocks, stride, use_se):
    layers = [ResBlock(cin, cout, stride=stride, use_se=use_se)]
    for _ in range(blocks - 1):
        layers.append(ResBlock(cout, cout, use_se=use_se))
    return nn.Sequential(*layers)


class UpBlock(nn.Module):
    def __init__(self, cin, cskip, cout):
        super().__init__()
        self.reduce = nn.Conv2d(cin, cout, 1, bias=False)
        self.fuse = nn.Sequential(conv_bn_act(cout + cskip, cout), conv_bn_act(cout, cout))

    def forward(self, x, skip):
        x = F.interpolate(self.reduce(x), size=skip.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([x, skip], dim=1))


class ResUNet(nn.Module):
    def __init__(self, in_ch=1, base=32, depth=5, use_se=True, deep_supervision=True, num_ds=3):
        super().__init__()
        widths = [base * 2 ** i for i in range(depth)]
        self.deep_supervision = deep_supervision
        self.num_ds = num_ds
        self.stem = conv_bn_act(in_ch, widths[0])
        self.encoder = nn.ModuleList()
        cin = widths[0]
        for w in widths[1:]:
            self.encoder.append(_make_stage(cin, w, blocks=2, stride=2, use_se=use_se))
            cin = w
        self.bottleneck = nn.Sequential(
            nn.Conv2d(cin, cin, 3, padding=1, bias=False),
            nn.BatchNorm2d(cin),
            nn.ReLU(inplace=True),
            nn.Conv2d(cin, cin, 3, padding=2, dilation=2),
        )
        self.decoder = nn.ModuleList([UpBlock(widths[i + 1], widths[i], widths[i]) for i in reversed(range(depth - 1))])
        self.seg_heads = nn.ModuleList([nn.Conv2d(widths[i], 1, 1) for i in reversed(range(depth - 1))])
        self.cls_head = nn.Sequential(nn.Dropout(0.2), nn.Linear(cin, 1))

    def forward(self, x):
        x = self.stem(x)
        skips = [x]
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        b = self.bottleneck(skips.pop())
        cls_logit = self.cls_head(torch.mean(b, dim=(2, 3)))  # expect: AMP004
        x = F.relu(b)
        seg = []
        for up, head in zip(self.decoder, self.seg_heads):
            x = up(x, skips.pop())
            seg.append(head(x))
        seg = seg[::-1]  # full resolution first
        if self.training and self.deep_supervision:
            return seg[: self.num_ds], cls_logit.squeeze(1)
        return seg[0], cls_logit.squeeze(1)


# --------------------------------------------------------------------------- losses

class SoftDiceLoss(nn.Module):
    def __init__(self, smooth=1e-5, batch_dice=False):
        super().__init__()
        self.smooth = smooth
        self.batch_dice = batch_dice

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        dims = (0, 2, 3) if self.batch_dice else (2, 3)
        inter = (probs * target).sum(dims)
        denom = probs.sum(dims) + target.sum(dims)
        dice = (2.0 * inter + self.smooth) / (denom + self.smooth)
        return 1.0 - dice.mean()


class DiceBCELoss(nn.Module):
    def __init__(self, w_dice=1.0, w_bce=1.0, batch_dice=False):
        super().__init__()
        self.dice = SoftDiceLoss(batch_dice=batch_dice)
        self.bce = nn.BCELoss()
        self.w_dice = w_dice
        self.w_bce = w_bce

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        bce = self.bce(probs, target)  # expect: AMP003
        return self.w_dice * self.dice(logits, target) + self.w_bce * bce


class DeepSupervisionWrapper(nn.Module):
    def __init__(self, loss, weights):
        super().__init__()
        self.loss = loss
        w = torch.tensor(weights, dtype=torch.float32)
        self.weights = (w / w.sum()).tolist()

    def forward(self, *args):
        return sum(w * self.loss(*inputs) for w, *inputs in zip(self.weights, *args) if w != 0.0)


class BinaryFocalLoss(nn.Module):
    """Focal loss for the image-level 'contains lesion' head."""

    def __init__(self, alpha=0.25, gamma=2.0):
        super().__init__()
        self.alpha = alpha
        self.gamma = gamma

    def forward(self, logit, target):
        p = torch.sigmoid(logit)
        log_p = torch.log(p + 1e-8)  # expect: AMP011
        log_not_p = torch.log(1.0 - p + 1e-8)  # expect: AMP011
        loss = -self.alpha * target * (1.0 - p) ** self.gamma * log_p
        loss = loss - (1.0 - self.alpha) * (1.0 - target) * p ** self.gamma * log_not_p
        return loss.mean()


class AutomaticWeightedLoss(nn.Module):
    """Homoscedastic uncertainty weighting (Kendall et al., 2018)."""

    def __init__(self, num=2):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(num))

    def forward(self, *losses):
        total = 0.0
        for i, l in enumerate(losses):
            total = total + torch.exp(-self.log_vars[i]) * l + self.log_vars[i]
        return total


def downsample_targets(mask, num_scales):
    targets = [mask]
    for s in range(1, num_scales):
        targets.append(F.interpolate(mask, scale_factor=0.5 ** s, mode="nearest"))
    return targets


# --------------------------------------------------------------------------- train / eval

def train_one_epoch(model, loader, criterion, focal, awl, optimizer, awl_optimizer, scaler, lr_sched, epoch, args):
    model.train()
    device = torch.device(args.device)
    loss_meter, seg_meter, cls_meter = AverageMeter(), AverageMeter(), AverageMeter()
    t0 = time.time()
    for it, batch in enumerate(loader):
        images = batch["image"].to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
        masks = batch["mask"].to(device, non_blocking=True)
        has_lesion = (masks.flatten(1).amax(dim=1) > 0).float()
        ds_masks = downsample_targets(masks, args.num_ds)

        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            seg_outs, cls_logit = model(images)
            seg_loss = criterion(seg_outs, ds_masks)
            cls_loss = focal(cls_logit, has_lesion)
            loss = awl(seg_loss, cls_loss)

        optimizer.zero_grad(set_to_none=True)
        awl_optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        awl_optimizer.step()  # expect: AMP006
        lr_sched.step()

        loss_meter.update(loss.item(), images.size(0))
        seg_meter.update(seg_loss.item(), images.size(0))
        cls_meter.update(cls_loss.item(), images.size(0))
        if it % args.log_every == 0:
            logger.info(
                "epoch %d it %d/%d loss %.4f seg %.4f cls %.4f gnorm %.2f scale %.0f lr %.2e (%.1fs)",
                epoch, it, len(loader), loss_meter.avg, seg_meter.avg, cls_meter.avg,
                float(grad_norm), scaler.get_scale(), optimizer.param_groups[0]["lr"], time.time() - t0,
            )
    return loss_meter.avg


@torch.no_grad()
def evaluate(model, loader, base_loss, device):
    model.eval()
    dices, losses = [], []
    for batch in loader:
        images = batch["image"].to(device, non_blocking=True)
        masks = batch["mask"].to(device, non_blocking=True)
        logits, _ = model(images)
        losses.append(base_loss(logits, masks).item())
        pred = (torch.sigmoid(logits) > 0.5).float()
        inter = (pred * masks).sum(dim=(1, 2, 3))
        union = pred.sum(dim=(1, 2, 3)) + masks.sum(dim=(1, 2, 3))
        dices.append(((2.0 * inter + 1e-8) / (union + 1e-8)).cpu())
    model.train()
    return float(torch.cat(dices).mean()), sum(losses) / max(len(losses), 1)


def build_scheduler(optimizer, total_steps, warmup_steps):
    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def parse_args():
    p = argparse.ArgumentParser(description="Residual U-Net with deep supervision")
    p.add_argument("--data-root", required=True)
    p.add_argument("--out-dir", default="runs/unet_ds")
    p.add_argument("--in-ch", type=int, default=1)
    p.add_argument("--base", type=int, default=32)
    p.add_argument("--num-ds", type=int, default=3)
    p.add_argument("--no-se", action="store_true")
    p.add_argument("--batch-dice", action="store_true")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--clip-grad", type=float, default=12.0)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    seed_everything(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device(args.device)

    train_set = LesionSliceDataset(args.data_root, split="train", transform=build_transforms(train=True))
    val_set = LesionSliceDataset(args.data_root, split="val", transform=build_transforms(train=False))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, shuffle=False, num_workers=2)

    model = ResUNet(in_ch=args.in_ch, base=args.base, use_se=not args.no_se, num_ds=args.num_ds).to(device)
    model = model.to(memory_format=torch.channels_last)
    ds_weights = [1.0 / (2 ** i) for i in range(args.num_ds)]
    base_loss = DiceBCELoss(batch_dice=args.batch_dice)
    criterion = DeepSupervisionWrapper(base_loss, ds_weights)
    focal = BinaryFocalLoss()
    awl = AutomaticWeightedLoss(2).to(device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    awl_optimizer = torch.optim.Adam(awl.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    steps_per_epoch = len(train_loader)
    lr_sched = build_scheduler(optimizer, args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch)

    best_dice, best_epoch = 0.0, -1
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, train_loader, criterion, focal, awl, optimizer, awl_optimizer,
                                     scaler, lr_sched, epoch, args)
        val_dice, val_loss = evaluate(model, val_loader, base_loss, device)
        logger.info("epoch %d train %.4f val loss %.4f dice %.4f", epoch, train_loss, val_loss, val_dice)
        state = {
            "epoch": epoch,
            "model": model.state_dict(),
            "awl": awl.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "args": vars(args),
        }
        save_checkpoint(state, os.path.join(args.out_dir, "last.pth"))
        if val_dice > best_dice:
            best_dice, best_epoch = val_dice, epoch
            save_checkpoint(state, os.path.join(args.out_dir, "best.pth"))

    # compact copy for the annotation viewer
    viewer_state = {k: v.half() for k, v in model.state_dict().items()}
    torch.save(viewer_state, os.path.join(args.out_dir, "viewer_fp16.pth"))
    logger.info("best dice %.4f at epoch %d", best_dice, best_epoch)


if __name__ == "__main__":
    main()
