"""Multi-task dense prediction on NYUv2: semantic segmentation, depth and surface normals.

Shared ResNet-50 + FPN trunk, one light head per task (kept in an nn.ModuleDict),
task losses balanced with homoscedastic uncertainty (Kendall et al., CVPR 2018).
The depth head predicts depth and a per-pixel confidence. fp16 autocast + GradScaler.

    python train_mtl.py --data /datasets/nyuv2 --tasks semseg depth normals --amp
"""
import argparse
import json
import logging
import math
import os
import time
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.models import ResNet50_Weights, resnet50
from torchvision.models._utils import IntermediateLayerGetter

from nyu import NYUv2MultiTask
from utils.dist import init_distributed, is_main_process
from utils.metrics import ConfusionMatrix

logger = logging.getLogger("mtl")

TASK_CHANNELS = {"depth": 2, "normals": 3}


class FPNDecoder(nn.Module):
    def __init__(self, in_channels_list, out_ch=128):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, out_ch, 1) for c in in_channels_list)
        self.smooth = nn.ModuleList(nn.Conv2d(out_ch, out_ch, 3, padding=1) for _ in in_channels_list)
        self.fuse = nn.Conv2d(out_ch * len(in_channels_list), out_ch, 1)

    def forward(self, feats):
        lat = [conv(f) for conv, f in zip(self.lateral, feats)]
        for i in range(len(lat) - 1, 0, -1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], size=lat[i - 1].shape[-2:], mode="nearest")
        size = lat[0].shape[-2:]
        outs = [F.interpolate(conv(x), size=size, mode="bilinear", align_corners=False)
                for conv, x in zip(self.smooth, lat)]
        return F.relu(self.fuse(torch.cat(outs, dim=1)))


def make_head(task, in_ch, num_classes):
    out_ch = num_classes if task == "semseg" else TASK_CHANNELS[task]
    return nn.Sequential(
        nn.Conv2d(in_ch, in_ch, 3, padding=1, bias=False),
        nn.BatchNorm2d(in_ch),
        nn.ReLU(inplace=True),
        nn.Conv2d(in_ch, out_ch, 1),
    )


class MultiTaskNet(nn.Module):
    def __init__(self, tasks, num_classes, pretrained=True):
        super().__init__()
        trunk = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2 if pretrained else None,
                         replace_stride_with_dilation=[False, False, True])
        self.backbone = IntermediateLayerGetter(trunk, {"layer1": "c2", "layer2": "c3", "layer3": "c4", "layer4": "c5"})
        self.decoder = FPNDecoder([256, 512, 1024, 2048], out_ch=128)
        self.heads = nn.ModuleDict({t: make_head(t, 128, num_classes) for t in tasks})

    def forward(self, images):
        feats = list(self.backbone(images).values())
        x = F.interpolate(self.decoder(feats), size=images.shape[-2:], mode="bilinear", align_corners=False)
        return {task: head(x) for task, head in self.heads.items()}


def depth_smoothness(depth):
    """Total variation of mean-normalised depth, so the term does not depend on scale."""
    mean_depth = depth.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
    norm_depth = depth / (mean_depth + 1e-8)  # expect: AMP011
    dx = (norm_depth[..., :, 1:] - norm_depth[..., :, :-1]).abs()
    dy = (norm_depth[..., 1:, :] - norm_depth[..., :-1, :]).abs()
    return dx.mean() + dy.mean()  # expect: AMP004


class DepthLoss(nn.Module):
    def __init__(self, max_depth=10.0, min_depth=1e-3, lam=0.85, beta=0.1, smooth_weight=1e-3):
        super().__init__()
        self.max_depth, self.min_depth = max_depth, min_depth
        self.lam, self.beta, self.smooth_weight = lam, beta, smooth_weight

    def forward(self, pred, target):
        depth = torch.sigmoid(pred[:, :1]) * self.max_depth
        conf = torch.sigmoid(pred[:, 1:])
        valid = target > self.min_depth
        # scale-invariant log error (Eigen et al., 2014)
        d = torch.log(depth[valid] + 1e-8) - torch.log(target[valid])  # expect: AMP011
        silog = torch.sqrt((d ** 2).mean() - self.lam * d.mean() ** 2) * 10.0
        # confidence-weighted L1, with a log barrier keeping confidence from collapsing
        err = conf * (depth - target).abs() - self.beta * torch.log(conf + 1e-8)  # expect: AMP011
        l1 = err[valid].mean()
        smooth = depth_smoothness(depth)
        return silog + l1 + self.smooth_weight * smooth


class NormalLoss(nn.Module):
    """Mean angular error between predicted and ground-truth unit normals."""

    def forward(self, pred, target):
        # acos has an unbounded gradient near +-1; keep this loss out of autocast
        with torch.autocast("cuda", enabled=False):
            pred = F.normalize(pred, dim=1)  # expect: AMP011
            valid = target.abs().sum(dim=1) > 0
            cos = (pred * target).sum(dim=1).clamp(-1 + 1e-7, 1 - 1e-7)
            return torch.acos(cos[valid]).mean()


LOSSES = {
    "semseg": lambda cfg: nn.CrossEntropyLoss(ignore_index=255),
    "depth": lambda cfg: DepthLoss(max_depth=cfg.max_depth),
    "normals": lambda cfg: NormalLoss(),
}


class UncertaintyWeightedLoss(nn.Module):
    def __init__(self, tasks, cfg):
        super().__init__()
        self.losses = nn.ModuleDict({t: LOSSES[t](cfg) for t in tasks})
        self.log_vars = nn.ParameterDict({t: nn.Parameter(torch.zeros(())) for t in tasks})

    def forward(self, preds, targets):
        total, parts = 0.0, {}
        for task, loss_fn in self.losses.items():
            value = loss_fn(preds[task], targets[task])
            total = total + torch.exp(-self.log_vars[task]) * value + self.log_vars[task]
            parts[task] = value.detach()
        return total, parts


def clip_gradients(model, max_norm):
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def train_one_epoch(model, criterion, loader, optimizer, scaler, scheduler, epoch, cfg):
    model.train()
    t0 = time.time()
    for it, (images, targets) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        targets = {k: v.cuda(non_blocking=True) for k, v in targets.items()}

        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            preds = model(images)
            loss, parts = criterion(preds, targets)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        grad_norm = clip_gradients(model, cfg.clip_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if it % cfg.log_every == 0 and is_main_process():
            logger.info("ep %d it %d/%d loss %.4f %s |g| %.2f sigma %s %.2fs/it", epoch, it, len(loader),
                        loss.item(), {k: round(v.item(), 4) for k, v in parts.items()}, grad_norm.item(),
                        {k: round(math.exp(0.5 * v.item()), 3) for k, v in criterion.log_vars.items()},
                        (time.time() - t0) / (it + 1))


@torch.no_grad()
def evaluate(model, loader, cfg):
    model.eval()
    conf_mat = ConfusionMatrix(cfg.num_classes)
    abs_rel, rmse, ang, n = 0.0, 0.0, 0.0, 0
    for images, targets in loader:
        images = images.cuda(non_blocking=True)
        targets = {k: v.cuda(non_blocking=True) for k, v in targets.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            preds = model(images)
        if "semseg" in preds:
            conf_mat.update(targets["semseg"].flatten(), preds["semseg"].argmax(1).flatten())
        if "depth" in preds:
            depth = torch.sigmoid(preds["depth"][:, :1].float()) * cfg.max_depth
            gt = targets["depth"]
            valid = gt > 1e-3
            abs_rel += ((depth - gt).abs() / gt)[valid].mean().item()
            rmse += ((depth - gt) ** 2)[valid].mean().sqrt().item()
        if "normals" in preds:
            pn = F.normalize(preds["normals"].float(), dim=1)
            cos = (pn * targets["normals"]).sum(1).clamp(-1, 1)
            ang += torch.rad2deg(torch.acos(cos)).mean().item()
        n += 1
    miou = conf_mat.compute()["miou"] if "semseg" in cfg.tasks else float("nan")
    return {"miou": miou, "abs_rel": abs_rel / max(n, 1), "rmse": rmse / max(n, 1), "mean_angle": ang / max(n, 1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--tasks", nargs="+", default=["semseg", "depth", "normals"])
    p.add_argument("--num-classes", type=int, default=40)
    p.add_argument("--max-depth", type=float, default=10.0)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-norm", type=float, default=10.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", default="runs/mtl")
    cfg = SimpleNamespace(**vars(p.parse_args()))
    init_distributed()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(cfg.out, exist_ok=True)

    train_set = NYUv2MultiTask(cfg.data, split="train", tasks=cfg.tasks, augment=True)
    val_set = NYUv2MultiTask(cfg.data, split="val", tasks=cfg.tasks)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, num_workers=4)

    model = MultiTaskNet(cfg.tasks, cfg.num_classes).cuda()
    criterion = UncertaintyWeightedLoss(cfg.tasks, cfg).cuda()
    optimizer = torch.optim.AdamW([
        {"params": model.backbone.parameters(), "lr": cfg.lr},
        {"params": list(model.decoder.parameters()) + list(model.heads.parameters()), "lr": cfg.lr * 10},
        {"params": criterion.parameters(), "lr": cfg.lr * 10, "weight_decay": 0.0},
    ], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=cfg.epochs * len(train_loader), power=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)

    best = float("inf")
    for epoch in range(cfg.epochs):
        train_one_epoch(model, criterion, train_loader, optimizer, scaler, scheduler, epoch, cfg)
        metrics = evaluate(model, val_loader, cfg)
        if is_main_process():
            logger.info("epoch %d %s", epoch, json.dumps(metrics))
            if metrics["abs_rel"] < best:
                best = metrics["abs_rel"]
                torch.save({"model": model.state_dict(), "criterion": criterion.state_dict(), "epoch": epoch},
                           os.path.join(cfg.out, "best.pth"))


if __name__ == "__main__":
    main()
