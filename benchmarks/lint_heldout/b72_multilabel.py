"""Multi-label image classification (COCO / NUS-WIDE / OpenImages subsets).

Stages:
  1. ``train``     : end-to-end training, optionally distilled from a larger teacher.
  2. ``crt``       : classifier re-training on a class-balanced sampler, backbone frozen.
  3. ``probe``     : linear probe of a frozen backbone (bf16).
"""
import argparse
import logging
import os
import time

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score

from mlc.data import build_loaders, class_frequencies
from mlc.utils import AverageMeter, ModelEma, save_checkpoint

logger = logging.getLogger("mlc")


class MultiLabelNet(nn.Module):
    def __init__(self, arch, num_classes, pretrained=True, drop_rate=0.2):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=pretrained, num_classes=0, drop_rate=drop_rate)
        self.num_features = self.backbone.num_features
        self.head = nn.Linear(self.num_features, num_classes)

    def forward(self, x):
        return self.head(self.backbone(x))


class AsymmetricLoss(nn.Module):
    """ASL (Ridnik et al. 2021), computed in fp32."""

    def __init__(self, gamma_neg=4, gamma_pos=0, clip=0.05, eps=1e-8):
        super().__init__()
        self.gamma_neg, self.gamma_pos, self.clip, self.eps = gamma_neg, gamma_pos, clip, eps

    def forward(self, logits, targets):
        x = logits.float()
        xs_pos = torch.sigmoid(x)
        xs_neg = 1 - xs_pos
        if self.clip and self.clip > 0:
            xs_neg = (xs_neg + self.clip).clamp(max=1)
        los_pos = targets * torch.log(xs_pos.clamp(min=self.eps))
        los_neg = (1 - targets) * torch.log(xs_neg.clamp(min=self.eps))
        loss = los_pos + los_neg
        pt = xs_pos * targets + xs_neg * (1 - targets)
        gamma = self.gamma_pos * targets + self.gamma_neg * (1 - targets)
        loss = loss * torch.pow(1 - pt, gamma)
        return -loss.sum() / x.size(0)


class LabelSmoothingBCE(nn.Module):
    def __init__(self, smoothing=0.1, pos_weight=None):
        super().__init__()
        self.smoothing = smoothing
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, logits, targets):
        targets = targets * (1.0 - self.smoothing) + 0.5 * self.smoothing
        return F.binary_cross_entropy_with_logits(logits, targets, pos_weight=self.pos_weight)


def sigmoid_focal_bce_loss(logits, targets, gamma=2.0, alpha=0.25):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy(p, targets, reduction="none")  # expect: AMP003
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * (1 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.sum() / targets.sum().clamp(min=1.0)


class Distiller(nn.Module):
    """Student trained on the labels and on the teacher's per-class probabilities."""

    def __init__(self, student, teacher, temperature=2.0, alpha=0.5):
        super().__init__()
        self.student = student
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature = temperature
        self.alpha = alpha
        self.hard_criterion = nn.BCEWithLogitsLoss()
        self.kd_criterion = nn.BCELoss()

    def forward(self, images, targets):
        logits = self.student(images)
        with torch.no_grad():
            t_logits = self.teacher(images)
        t = self.temperature
        hard = self.hard_criterion(logits, targets)
        soft = self.kd_criterion(torch.sigmoid(logits / t), torch.sigmoid(t_logits / t))  # expect: AMP003
        loss = (1 - self.alpha) * hard + self.alpha * soft * t * t
        return {"loss": loss, "hard": hard.detach(), "soft": soft.detach(), "logits": logits}


def build_criterion(name, pos_weight=None):
    if name == "bce":
        return nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    if name == "asl":
        return AsymmetricLoss()
    if name == "ls_bce":
        return LabelSmoothingBCE(0.1, pos_weight)
    raise ValueError(f"unknown loss {name}")


def train_one_epoch(model, distiller, criterion, loader, optimizer, scaler, ema, epoch, args):
    model.train()
    meter = AverageMeter()
    for i, (images, targets) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True).float()
        with torch.autocast("cuda", dtype=torch.float16):
            if distiller is not None:
                out = distiller(images, targets)
                loss = out["loss"]
            elif args.loss == "focal":
                loss = sigmoid_focal_bce_loss(model(images), targets, gamma=args.focal_gamma)
            else:
                loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        if ema is not None:
            ema.update(model)
        meter.update(loss.item(), images.size(0))
        if i % args.print_freq == 0:
            logger.info("train epoch %d [%d/%d] loss %.4f", epoch, i, len(loader), meter.avg)
    return meter.avg


def retrain_classifier(model, loader, class_freq, epochs, lr):
    """cRT: keep the representation, re-learn the classifier on class-balanced batches."""
    model.backbone.requires_grad_(False)
    model.head.reset_parameters()
    pos_weight = torch.as_tensor((1.0 - class_freq) / class_freq.clip(min=1e-4), dtype=torch.float32).cuda()
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight.clamp(max=50.0))
    optimizer = torch.optim.SGD(model.head.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        model.train()
        model.backbone.eval()
        for images, targets in loader:
            images, targets = images.cuda(non_blocking=True), targets.cuda(non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images)
            loss = criterion(logits, targets)  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        logger.info("cRT epoch %d loss %.4f", epoch, loss.item())


def linear_probe(backbone, train_loader, num_classes, epochs=20, lr=0.1):
    backbone.eval().requires_grad_(False)
    head = nn.Linear(backbone.num_features, num_classes).cuda()
    optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9)
    criterion = nn.BCEWithLogitsLoss()
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    for epoch in range(epochs):
        for images, targets in train_loader:
            images, targets = images.cuda(non_blocking=True), targets.cuda(non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    feats = backbone(images)
                logits = head(feats)
                loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return head


@torch.no_grad()
def predict_logits(model, loader):
    model.eval()
    all_logits, all_targets = [], []
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images.cuda(non_blocking=True))
        all_logits.append(logits.float().cpu())
        all_targets.append(targets.float())
    return torch.cat(all_logits), torch.cat(all_targets)


def fit_temperature(logits, targets, steps=100):
    """Single temperature for calibrated per-class probabilities (fit on the val split)."""
    logits, targets = logits.cuda(), targets.cuda()
    log_t = nn.Parameter(torch.zeros(1, device="cuda"))
    optimizer = torch.optim.LBFGS([log_t], lr=0.05, max_iter=steps)

    def closure():
        optimizer.zero_grad()
        with torch.autocast("cuda", enabled=False):
            probs = torch.sigmoid(logits.float() / log_t.exp())
            loss = F.binary_cross_entropy(probs, targets)
        loss.backward()
        return loss

    optimizer.step(closure)
    return log_t.exp().item()


def mean_average_precision(logits, targets):
    scores = torch.sigmoid(logits).numpy()
    targets = targets.numpy()
    valid = targets.sum(0) > 0
    return float(np.mean([average_precision_score(targets[:, c], scores[:, c]) for c in np.where(valid)[0]]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", choices=["train", "crt", "probe"], default="train")
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="tresnet_m")
    p.add_argument("--num-classes", type=int, default=80)
    p.add_argument("--loss", default="asl", choices=["bce", "asl", "ls_bce", "focal"])
    p.add_argument("--focal-gamma", type=float, default=2.0)
    p.add_argument("--teacher", default=None)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-grad", type=float, default=5.0)
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--resume", default=None)
    p.add_argument("--output", default="output/mlc")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)

    train_loader, val_loader, balanced_loader = build_loaders(args.data, batch_size=64)
    model = MultiLabelNet(args.arch, args.num_classes).cuda()
    if args.resume:
        model.load_state_dict(torch.load(args.resume, map_location="cpu")["model"])

    if args.stage == "crt":
        retrain_classifier(model, balanced_loader, class_frequencies(args.data), epochs=10, lr=0.05)
    elif args.stage == "probe":
        linear_probe(model.backbone, train_loader, args.num_classes)
        return
    else:
        distiller = None
        if args.teacher:
            teacher = MultiLabelNet("tresnet_xl", args.num_classes, pretrained=False).cuda()
            teacher.load_state_dict(torch.load(args.teacher, map_location="cpu")["model"])
            distiller = Distiller(model, teacher)
        criterion = None if args.loss == "focal" else build_criterion(args.loss)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        scaler = torch.amp.GradScaler("cuda")
        ema = ModelEma(model, decay=0.9997)
        best_map = 0.0
        for epoch in range(args.epochs):
            t0 = time.time()
            train_loss = train_one_epoch(model, distiller, criterion, train_loader, optimizer, scaler, ema, epoch, args)
            logits, targets = predict_logits(ema.module, val_loader)
            mAP = mean_average_precision(logits, targets)
            logger.info("epoch %d loss %.4f mAP %.2f (%.0fs)", epoch, train_loss, 100 * mAP, time.time() - t0)
            if mAP > best_map:
                best_map = mAP
                save_checkpoint({"model": ema.module.state_dict(), "map": mAP}, os.path.join(args.output, "best.pth"))

    logits, targets = predict_logits(model, val_loader)
    temperature = fit_temperature(logits, targets)
    logger.info("final mAP %.2f, fitted temperature %.3f", 100 * mean_average_precision(logits, targets), temperature)


if __name__ == "__main__":
    main()
