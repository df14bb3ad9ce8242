"""3D UNet for organ segmentation (CT volumes), sliding-window validation, AMP training."""
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter

from seg3d.data import get_loaders
from seg3d.nets import UNet3D
from seg3d.infer import sliding_window_inference


class DiceBCELoss(nn.Module):
    def __init__(self, smooth: float = 1.0, bce_weight: float = 0.5):
        super().__init__()
        self.smooth, self.bce_weight = smooth, bce_weight

    def forward(self, probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        inter = (probs * target).sum(dim=(2, 3, 4))
        union = probs.sum(dim=(2, 3, 4)) + target.sum(dim=(2, 3, 4))
        dice = 1 - (2 * inter + self.smooth) / (union + self.smooth)
        bce = F.binary_cross_entropy(probs, target)  # expect: AMP003
        return self.bce_weight * bce + (1 - self.bce_weight) * dice.mean()


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def train(args):
    writer = SummaryWriter(os.path.join(args.out, "tb"))
    train_loader, val_loader = get_loaders(args.data, patch=(96, 96, 96), batch_size=2)
    model = UNet3D(in_channels=1, out_channels=14).cuda()
    loss_fn = DiceBCELoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-5)
    scaler = torch.amp.GradScaler("cuda")
    best_dice, global_step = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            image, label = batch["image"].cuda(), batch["label"].cuda()
            target = F.one_hot(label.long().squeeze(1), 14).permute(0, 4, 1, 2, 3).float()
            with torch.autocast("cuda"):
                probs = torch.sigmoid(model(image))
                loss = loss_fn(probs, target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            grad_norm = clip_gradients(model, 12.0)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            if args.sam:
                # second step of sharpness-aware minimisation re-uses the same gradients
                optimizer.step()  # expect: AMP006
            writer.add_scalar("train/loss", loss.item(), global_step)
            writer.add_scalar("train/grad_norm", grad_norm, global_step)
            global_step += 1

        if epoch % args.val_every == 0:
            dice = validate(model, val_loader)
            writer.add_scalar("val/dice", dice, epoch)
            if dice > best_dice:
                best_dice = dice
                torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


@torch.no_grad()
def validate(model, loader):
    model.eval()
    scores = []
    for batch in loader:
        with torch.autocast("cuda"):
            logits = sliding_window_inference(batch["image"].cuda(), (96, 96, 96), 4, model, overlap=0.5)
        pred = logits.float().argmax(1)
        label = batch["label"].cuda().squeeze(1)
        for c in range(1, 14):
            inter = ((pred == c) & (label == c)).sum().item()
            denom = (pred == c).sum().item() + (label == c).sum().item()
            scores.append(2 * inter / denom if denom else np.nan)
    model.train()
    return float(np.nanmean(scores))
