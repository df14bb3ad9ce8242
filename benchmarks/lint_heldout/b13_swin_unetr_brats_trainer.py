"""BraTS 2021 tumour sub-region segmentation with SwinUNETR (MONAI) + a boundary head.

Trainer with gradient accumulation, sliding-window validation and an EMA of the weights.
"""
import argparse
import os
import time
from copy import deepcopy

import torch
import torch.nn as nn
import torch.nn.functional as F
from monai.data import DataLoader, decollate_batch
from monai.inferers import sliding_window_inference
from monai.metrics import DiceMetric
from monai.networks.nets import SwinUNETR


class DiceBCELoss(nn.Module):
    """Multi-label (TC/WT/ET) Dice + BCE on sigmoid probabilities."""

    def __init__(self, smooth=1e-5, bce_weight=0.5):
        super().__init__()
        self.smooth = smooth
        self.bce_weight = bce_weight
        self.bce = nn.BCELoss()

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        dims = (2, 3, 4)
        inter = (probs * target).sum(dims)
        denom = probs.sum(dims) + target.sum(dims)
        dice = 1.0 - ((2.0 * inter + self.smooth) / (denom + self.smooth)).mean()
        return dice + self.bce_weight * self.bce(probs, target)  # expect: AMP003


class BoundaryHead(nn.Module):
    def __init__(self, in_ch=4, width=16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv3d(in_ch, width, 3, padding=1), nn.InstanceNorm3d(width), nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(width, 1, 1),
        )

    def forward(self, x):
        return self.net(x)


class ModelEMA:
    def __init__(self, model, decay=0.999):
        self.ema = deepcopy(model).eval()
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1 - self.decay)


def warmup_boundary_head(head, loader, device, steps=200, lr=1e-3):
    """Pre-train the boundary head alone for a few hundred steps (edges from the label maps)."""
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    for step, batch in enumerate(loader):
        if step >= steps:
            break
        img = batch["image"].to(device)
        seg = batch["label"].to(device).float()
        edge = (F.max_pool3d(seg, 3, 1, 1) - seg).amax(1, keepdim=True).clamp_(0, 1)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            logits = head(img)
            probs = torch.sigmoid(logits)
            edge_loss = F.binary_cross_entropy_with_logits(logits, edge)
            ent = -(probs * torch.log(probs + 1e-8)).mean()  # expect: AMP011
            loss = edge_loss + 0.01 * ent
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return head


class BratsTrainer:
    def __init__(self, args, train_loader, val_loader):
        self.args = args
        self.device = torch.device("cuda")
        self.model = SwinUNETR(img_size=(128, 128, 128), in_channels=4, out_channels=3, feature_size=48,
                               use_checkpoint=True).to(self.device)
        self.boundary = BoundaryHead().to(self.device)
        self.train_loader, self.val_loader = train_loader, val_loader
        params = list(self.model.parameters()) + list(self.boundary.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-5)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=args.max_epochs)
        self.loss_fn = DiceBCELoss()
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        self.ema = ModelEMA(self.model)
        self.dice_metric = DiceMetric(include_background=True, reduction="mean_batch")
        self.iteration = 0

    def forward_loss(self, image, label):
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.amp):
            logits = self.model(image)
            b_logits = self.boundary(image)
            edge = (F.max_pool3d(label, 3, 1, 1) - label).amax(1, keepdim=True)
            loss = self.loss_fn(logits, label)
            loss = loss + 0.2 * F.binary_cross_entropy_with_logits(b_logits, edge)
        return loss

    def optimizer_step(self):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)  # expect: AMP005
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update(self.model)
        return grad_norm

    def train_epoch(self, epoch):
        self.model.train()
        t0, total = time.time(), 0.0
        for idx, batch in enumerate(self.train_loader):
            image = batch["image"].to(self.device, dtype=torch.float16)  # expect: AMP001
            label = batch["label"].to(self.device).float()
            loss = self.forward_loss(image, label)
            self.scaler.scale(loss / self.args.accum).backward()
            total += loss.item()
            if (idx + 1) % self.args.accum == 0:
                gn = self.optimizer_step()
                self.iteration += 1
                if self.iteration % 20 == 0:
                    print(f"epoch {epoch} it {self.iteration} loss {loss.item():.4f} gn {gn:.3f} "
                          f"{(time.time() - t0) / (idx + 1):.2f}s/it")
        self.scheduler.step()
        return total / len(self.train_loader)

    @torch.no_grad()
    def validate(self, model):
        model.eval()
        self.dice_metric.reset()
        for batch in self.val_loader:
            image, label = batch["image"].to(self.device), batch["label"].to(self.device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.amp):
                logits = sliding_window_inference(image, (128, 128, 128), 4, model, overlap=0.5)
            preds = [(torch.sigmoid(p.float()) > 0.5).float() for p in decollate_batch(logits)]
            self.dice_metric(y_pred=preds, y=decollate_batch(label))
        tc, wt, et = self.dice_metric.aggregate().tolist()
        return tc, wt, et

    def fit(self):
        warmup_boundary_head(self.boundary, self.train_loader, self.device)
        best = -1.0
        for epoch in range(self.args.max_epochs):
            tr_loss = self.train_epoch(epoch)
            if (epoch + 1) % self.args.val_every == 0:
                tc, wt, et = self.validate(self.ema.ema)
                mean_dice = (tc + wt + et) / 3
                print(f"epoch {epoch}: loss {tr_loss:.4f} dice TC {tc:.4f} WT {wt:.4f} ET {et:.4f}")
                if mean_dice > best:
                    best = mean_dice
                    torch.save({"epoch": epoch, "state_dict": self.model.state_dict(),
                                "ema": self.ema.ema.state_dict(), "scaler": self.scaler.state_dict(),
                                "best_dice": best}, os.path.join(self.args.logdir, "model_best.pt"))
        return best


def get_args():
    p = argparse.ArgumentParser("SwinUNETR BraTS")
    p.add_argument("--data-dir", default="/dataset/brats2021")
    p.add_argument("--logdir", default="runs/swin_unetr")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=12.0)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--max-epochs", type=int, default=300)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    from brats_data import get_loaders  # project-local MONAI transforms and datasets

    args = get_args()
    os.makedirs(args.logdir, exist_ok=True)
    tl, vl = get_loaders(args.data_dir, batch_size=1)
    BratsTrainer(args, tl, vl).fit()
