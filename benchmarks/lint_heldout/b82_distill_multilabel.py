"""Distil a frozen multi-label teacher (ConvNeXt-L, fp16) into a small ResNet-style student.

Objective = BCE-with-logits on the labels
          + soft-target BCE on temperature-scaled sigmoid outputs
          + FitNets hint on the last feature map
          + confidence penalty on the student's probabilities.

    torchrun --nproc_per_node 1 distill_multilabel.py --data-root /data/coco --teacher-ckpt t.pth
"""
import argparse
import copy
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.utils.data import DataLoader

from data.multilabel import build_multilabel_dataset
from utils.misc import AverageMeter

logger = logging.getLogger("kd")


def get_args():
    p = argparse.ArgumentParser("multi-label knowledge distillation")
    p.add_argument("--data-root", required=True)
    p.add_argument("--teacher", default="convnext_large.fb_in22k_ft_in1k")
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--num-classes", type=int, default=80)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--feat-dim", type=int, default=512)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--reg-lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha-kd", type=float, default=1.0)
    p.add_argument("--beta-hint", type=float, default=0.5)
    p.add_argument("--gamma-conf", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output", default="out/kd")
    p.add_argument("--resume", default="")
    return p.parse_args()


# --------------------------------------------------------------------------- models
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        if stride == 1 and cin == cout:
            self.shortcut = nn.Identity()
        else:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=True)


class StudentNet(nn.Module):
    def __init__(self, num_classes, width=64, feat_dim=512, drop=0.2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        layers, cin = [], width
        for i, c in enumerate([width, width * 2, width * 4, width * 8]):
            layers += [BasicBlock(cin, c, stride=1 if i == 0 else 2), BasicBlock(c, c)]
            cin = c
        self.stages = nn.Sequential(*layers)
        self.conv_head = nn.Conv2d(cin, feat_dim, 1)
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(feat_dim, num_classes)

    def forward_features(self, x):
        x = self.stem(x)
        x = self.stages(x)
        return self.conv_head(x)

    def forward(self, x, return_feat=False):
        feat = self.forward_features(x)
        pooled = feat.mean(dim=(2, 3))  # expect: AMP004
        logits = self.fc(self.drop(pooled))
        return (logits, feat) if return_feat else logits


class HintRegressor(nn.Module):
    """1x1 conv from the student's feature map to the teacher's channel count."""

    def __init__(self, cin, cout):
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, s_feat, size):
        return F.interpolate(self.proj(s_feat), size=size, mode="bilinear", align_corners=False)


def load_teacher(args, device):
    teacher = timm.create_model(args.teacher, pretrained=False, num_classes=args.num_classes)
    state = torch.load(args.teacher_ckpt, map_location="cpu")
    teacher.load_state_dict(state.get("model", state))
    teacher.requires_grad_(False)
    return teacher.to(device).half().eval()


def teacher_forward(teacher, images):
    feats = teacher.forward_features(images)
    logits = teacher.forward_head(feats)
    return logits.float(), feats


# --------------------------------------------------------------------------- losses
def soft_target_bce(student_logits, teacher_logits, temperature):
    """Multi-label KD: BCE between temperature-softened sigmoid outputs."""
    p_s = torch.sigmoid(student_logits / temperature)
    p_t = torch.sigmoid(teacher_logits / temperature)
    return F.binary_cross_entropy(p_s, p_t) * temperature ** 2  # expect: AMP003


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --------------------------------------------------------------------------- train / eval
def train_one_epoch(student, regressor, teacher, loader, optimizer, reg_optimizer, scheduler, scaler,
                    criterion, epoch, args, device):
    student.train()
    regressor.train()
    meters = {k: AverageMeter() for k in ("loss", "sup", "kd", "hint", "conf")}
    t0 = time.time()
    for it, (images, targets) in enumerate(loader):
        # the teacher runs in fp16
        images = images.to(device, non_blocking=True).half()  # expect: AMP001
        targets = targets.to(device, non_blocking=True).float()

        with torch.no_grad():
            t_logits, t_feat = teacher_forward(teacher, images)

        optimizer.zero_grad(set_to_none=True)
        reg_optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            s_logits, s_feat = student(images, return_feat=True)
            s_hint = regressor(s_feat, t_feat.shape[-2:])
            sup_loss = criterion(s_logits, targets)
            kd_loss = soft_target_bce(s_logits, t_logits, args.temperature)
            probs = torch.sigmoid(s_logits)
            conf_pen = (probs * torch.log(probs + 1e-8)).sum(dim=1).mean()  # expect: AMP011
        hint_loss = F.mse_loss(s_hint, t_feat)  # expect: AMP002
        loss = sup_loss + args.alpha_kd * kd_loss + args.beta_hint * hint_loss + args.gamma_conf * conf_pen

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        reg_optimizer.step()  # expect: AMP006
        scheduler.step()

        n = images.size(0)
        for k, v in (("loss", loss), ("sup", sup_loss), ("kd", kd_loss), ("hint", hint_loss), ("conf", conf_pen)):
            meters[k].update(v.item(), n)
        if it % 50 == 0:
            logger.info("ep %d it %d/%d loss %.4f (sup %.4f kd %.4f hint %.4f) gnorm %.2f scale %.0f %.1fs",
                        epoch, it, len(loader), meters["loss"].avg, meters["sup"].avg, meters["kd"].avg,
                        meters["hint"].avg, grad_norm, scaler.get_scale(), time.time() - t0)
    return {k: m.avg for k, m in meters.items()}


@torch.no_grad()
def evaluate(student, loader, device):
    student.eval()
    all_probs, all_targets = [], []
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = student(images)
        all_probs.append(torch.sigmoid(logits.float()).cpu())
        all_targets.append(targets)
    probs = torch.cat(all_probs).numpy()
    targets = torch.cat(all_targets).numpy()
    present = targets.sum(0) > 0
    return float(average_precision_score(targets[:, present], probs[:, present], average="macro"))


@torch.inference_mode()
def cache_teacher_logits(teacher, loader, path, device):
    logits = [teacher_forward(teacher, images.to(device).half())[0] for images, _ in loader]
    torch.save(torch.cat(logits).half().cpu(), path)


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    train_set = build_multilabel_dataset(args.data_root, split="train", img_size=args.img_size)
    val_set = build_multilabel_dataset(args.data_root, split="val", img_size=args.img_size)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, shuffle=False, num_workers=args.workers,
                            pin_memory=True)

    teacher = load_teacher(args, device)
    if not (out_dir / "teacher_val_logits.pt").exists():
        cache_teacher_logits(teacher, val_loader, out_dir / "teacher_val_logits.pt", device)

    student = StudentNet(args.num_classes, width=args.width, feat_dim=args.feat_dim).to(device)
    # the regressor is matched against the teacher's fp16 feature maps
    regressor = HintRegressor(args.feat_dim, teacher.num_features).to(device).half()  # expect: AMP001
    optimizer = torch.optim.AdamW(param_groups(student, args.weight_decay), lr=args.lr)
    reg_optimizer = torch.optim.Adam(regressor.parameters(), lr=args.reg_lr)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.05)
    scaler = torch.amp.GradScaler("cuda")
    criterion = nn.BCEWithLogitsLoss()

    start_epoch, best_map = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        student.load_state_dict(ckpt["student"])
        regressor.load_state_dict(ckpt["regressor"])
        optimizer.load_state_dict(ckpt["optimizer"])
        reg_optimizer.load_state_dict(ckpt["reg_optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_map = ckpt["epoch"] + 1, ckpt["best_map"]

    for epoch in range(start_epoch, args.epochs):
        stats = train_one_epoch(student, regressor, teacher, train_loader, optimizer, reg_optimizer, scheduler,
                                scaler, criterion, epoch, args, device)
        val_map = evaluate(student, val_loader, device)
        logger.info("epoch %d train %s val mAP %.4f", epoch, json.dumps(stats), val_map)
        state = {
            "student": student.state_dict(), "regressor": regressor.state_dict(),
            "optimizer": optimizer.state_dict(), "reg_optimizer": reg_optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "epoch": epoch, "best_map": max(best_map, val_map), "args": vars(args),
        }
        torch.save(state, out_dir / "last.pth")
        if val_map > best_map:
            best_map = val_map
            # fp16 copy for deployment
            torch.save(copy.deepcopy(student).half().state_dict(), out_dir / "student_best_fp16.pth")
    logger.info("best val mAP %.4f", best_map)


if __name__ == "__main__":
    main()
