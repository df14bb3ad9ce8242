"""Semantic segmentation trainer (UNet) with Dice + BCE losses and AMP."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class DiceLoss(nn.Module):
    def __init__(self, smooth=1.0):
        super().__init__()
        self.smooth = smooth

    def forward(self, logits, target):
        probs = torch.sigmoid(logits).flatten(1)
        target = target.flatten(1)
        inter = (probs * target).sum(1)
        union = probs.sum(1) + target.sum(1)
        return 1 - ((2 * inter + self.smooth) / (union + self.smooth)).mean()


class SegTrainer:
    def __init__(self, model, optimizer, scheduler, cfg):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = cfg
        self.dice = DiceLoss()
        self.bce = nn.BCELoss()
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)

    def train_step(self, images, masks):
        self.model.train()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            logits = self.model(images)
            probs = torch.sigmoid(logits)
            loss = self.bce(probs, masks) + self.dice(logits, masks)  # expect: AMP003
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(self.scaler.scale(loss))
        self.optimizer.step()  # expect: AMP006
        self.scheduler.step()
        return loss.item()

    def train_step_split(self, images, masks):
        self.model.train()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            logits = self.model(images)
        dice = self.dice(logits, masks)  # expect: AMP002
        bce = F.binary_cross_entropy_with_logits(logits.float(), masks)
        loss = dice + bce
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    def train_step_twice(self, images, masks):
        with torch.autocast("cuda", dtype=torch.float16):
            logits = self.model(images)
            loss = F.binary_cross_entropy_with_logits(logits, masks)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.cfg.lookahead:
            self.optimizer.step()  # expect: AMP006

    @torch.no_grad()
    def validate(self, loader):
        self.model.eval()
        scores = []
        for images, masks in loader:
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                logits = self.model(images.cuda())
            pred = (logits.float().sigmoid() > 0.5).float()
            inter = (pred * masks.cuda()).sum()
            scores.append((2 * inter / (pred.sum() + masks.sum() + 1e-6)).item())
        return sum(scores) / len(scores)
