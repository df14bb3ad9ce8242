"""Monocular depth estimation with deep supervision (auxiliary decoder outputs)."""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class SILogLoss(nn.Module):
    """Scale-invariant log loss (Eigen et al.)."""

    def __init__(self, lambd=0.85):
        super().__init__()
        self.lambd = lambd

    def forward(self, pred, target, mask):
        diff = torch.log(pred[mask]) - torch.log(target[mask])
        return torch.sqrt((diff ** 2).mean() - self.lambd * diff.mean() ** 2)


def gradient_loss(pred, target):
    dx_p = pred[..., :, 1:] - pred[..., :, :-1]
    dx_t = target[..., :, 1:] - target[..., :, :-1]
    dy_p = pred[..., 1:, :] - pred[..., :-1, :]
    dy_t = target[..., 1:, :] - target[..., :-1, :]
    return (dx_p - dx_t).abs().mean() + (dy_p - dy_t).abs().mean()


class DepthTrainer:
    def __init__(self, model, cfg):
        self.model = model.cuda()
        self.cfg = cfg
        self.silog = SILogLoss()
        self.l1 = nn.L1Loss()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=1e-2)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)

    def train_step(self, image, depth):
        mask = depth > 1e-3
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            pred, aux_preds = self.model(image)
            pred = F.interpolate(pred, size=depth.shape[-2:], mode="bilinear", align_corners=True)
        loss = self.silog(pred, depth, mask)  # expect: AMP002
        loss = loss + 0.5 * sum(self.l1(F.interpolate(a, size=depth.shape[-2:]), depth) for a in aux_preds)  # expect: AMP002
        loss = loss + 0.1 * gradient_loss(pred, depth)  # expect: AMP002
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), 0.1)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    def train_step_fp32_loss(self, image, depth):
        mask = depth > 1e-3
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            pred, _ = self.model(image)
        pred = F.interpolate(pred.float(), size=depth.shape[-2:], mode="bilinear", align_corners=True)
        loss = self.silog(pred, depth, mask) + 0.1 * gradient_loss(pred, depth)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        errs = []
        for image, depth in loader:
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                pred, _ = self.model(image.cuda())
            pred = F.interpolate(pred.float(), size=depth.shape[-2:], mode="bilinear")
            valid = depth.cuda() > 1e-3
            errs.append(((pred[valid] - depth.cuda()[valid]).abs() / depth.cuda()[valid]).mean().item())
        self.model.train()
        return sum(errs) / len(errs)


def regression_head_finetune(backbone, head, loader, epochs=5):
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    backbone.eval()
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    feats = backbone(x.cuda())
                preds = head(feats)
            loss = F.huber_loss(preds.squeeze(-1), y.cuda(), delta=1.0)  # expect: AMP002
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-4)
    cfg = parser.parse_args()
    os.makedirs("runs", exist_ok=True)
