# -*- coding: utf-8 -*-
"""SiamRPN++/SiamMask-lite training (pysot layout, one GPU).

    python tools/train_siammask.py --cfg experiments/siammask_lite/config.yaml
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.cuda import amp

logger = logging.getLogger("global")

DEFAULT_CFG = {
    "anchor": {"num": 5, "stride": 8},
    "train": {"epochs": 20, "base_lr": 0.005, "momentum": 0.9, "weight_decay": 1e-4, "amp": True,
              "grad_clip": 10.0, "unfix_epoch": 10, "log_every": 20, "snapshot_dir": "snapshot",
              "weights": {"cls": 1.0, "loc": 1.2, "mask": 36.0}},
    "track": {"penalty_k": 0.04, "window_influence": 0.44, "lr": 0.4, "score_size": 25},
}


def conv_bn_relu(cin, cout, k, s=1, p=0):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, p, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class AlexNetLite(nn.Module):
    def __init__(self, width=1.0):
        super().__init__()
        c = [3] + [int(x * width) for x in (96, 256, 384, 384, 256)]
        self.features = nn.Sequential(
            conv_bn_relu(c[0], c[1], 11, 2), nn.MaxPool2d(3, 2),
            conv_bn_relu(c[1], c[2], 5), nn.MaxPool2d(3, 2),
            conv_bn_relu(c[2], c[3], 3), conv_bn_relu(c[3], c[4], 3),
            nn.Conv2d(c[4], c[5], 3), nn.BatchNorm2d(c[5]),
        )
        self.out_channels = c[5]

    def forward(self, x):
        return self.features(x)


def xcorr_depthwise(x, kernel):
    batch, channel = kernel.size(0), kernel.size(1)
    x = x.view(1, batch * channel, x.size(2), x.size(3))
    kernel = kernel.view(batch * channel, 1, kernel.size(2), kernel.size(3))
    out = F.conv2d(x, kernel, groups=batch * channel)
    return out.view(batch, channel, out.size(2), out.size(3))


class DepthwiseXCorr(nn.Module):
    def __init__(self, in_channels, hidden, out_channels):
        super().__init__()
        self.conv_kernel = conv_bn_relu(in_channels, hidden, 3)
        self.conv_search = conv_bn_relu(in_channels, hidden, 3)
        self.head = nn.Sequential(conv_bn_relu(hidden, hidden, 1), nn.Conv2d(hidden, out_channels, 1))

    def forward(self, kernel, search, return_feature=False):
        feature = xcorr_depthwise(self.conv_search(search), self.conv_kernel(kernel))
        out = self.head(feature)
        return (out, feature) if return_feature else out


class SiamMaskLite(nn.Module):
    def __init__(self, num_anchors=5, hidden=256):
        super().__init__()
        self.backbone = AlexNetLite()
        c = self.backbone.out_channels
        self.cls_head = DepthwiseXCorr(c, hidden, num_anchors)
        self.loc_head = DepthwiseXCorr(c, hidden, 4 * num_anchors)
        self.mask_head = DepthwiseXCorr(c, hidden, hidden)
        self.refine = nn.Sequential(conv_bn_relu(hidden, 64, 3, p=1), nn.Conv2d(64, 1, 3, padding=1))
        self.zf = None

    def forward(self, template, search):
        zf, xf = self.backbone(template), self.backbone(search)
        cls = self.cls_head(zf, xf)
        loc = self.loc_head(zf, xf)
        mask_feat = self.mask_head(zf, xf)
        mask = self.refine(F.interpolate(mask_feat, size=search.shape[-2:], mode="bilinear", align_corners=False))
        return cls, loc, mask

    def template(self, z):
        self.zf = self.backbone(z)

    def track(self, x):
        xf = self.backbone(x)
        return self.cls_head(self.zf, xf), self.loc_head(self.zf, xf)


def get_cls_loss(pred, label, select):
    if len(select.size()) == 0 or select.size() == torch.Size([0]):
        return 0
    pred = torch.index_select(pred, 0, select)
    label = torch.index_select(label, 0, select)
    return F.binary_cross_entropy(pred, label)  # expect: AMP003


def select_cls_loss(cls, label):
    pred = torch.sigmoid(cls).view(-1)
    label = label.view(-1)
    pos = label.data.eq(1).nonzero().squeeze()
    neg = label.data.eq(0).nonzero().squeeze()
    return get_cls_loss(pred, label.float(), pos) * 0.5 + get_cls_loss(pred, label.float(), neg) * 0.5


def weight_l1_loss(pred_loc, label_loc, loss_weight):
    b, _, sh, sw = pred_loc.size()
    pred_loc = pred_loc.view(b, 4, -1, sh, sw)
    diff = (pred_loc - label_loc).abs().sum(dim=1).view(b, -1, sh, sw)
    return (diff * loss_weight).sum().div(b)


def prepare_batch(data, device):
    # images go over PCIe as fp16: halves the host->device copy of 255x255 search crops
    template = data["template"].to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
    search = data["search"].to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
    label_cls = data["label_cls"].to(device, non_blocking=True)
    label_loc = data["label_loc"].to(device, non_blocking=True)
    label_loc_weight = data["label_loc_weight"].to(device, non_blocking=True)
    gt_mask = data["mask"].to(device, non_blocking=True).float()
    return template, search, label_cls, label_loc, label_loc_weight, gt_mask


def build_scaler(cfg):
    return amp.GradScaler(enabled=cfg["train"]["amp"])  # expect: AMP009


def build_optimizer(model, cfg, epoch):
    trainable_backbone = epoch >= cfg["train"]["unfix_epoch"]
    for p in model.backbone.parameters():
        p.requires_grad_(trainable_backbone)
    groups = [{"params": [p for n, p in model.named_parameters() if not n.startswith("backbone")], "lr": cfg["train"]["base_lr"]}]
    if trainable_backbone:
        groups.append({"params": model.backbone.parameters(), "lr": cfg["train"]["base_lr"] * 0.1})
    return torch.optim.SGD(groups, momentum=cfg["train"]["momentum"], weight_decay=cfg["train"]["weight_decay"])


def optimizer_step(model, optimizer, scaler, max_norm):
    grad_norm = None
    if max_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_one_epoch(model, loader, optimizer, scaler, cfg, epoch, device):
    model.train()
    w = cfg["train"]["weights"]
    end = time.time()
    for it, data in enumerate(loader):
        template, search, label_cls, label_loc, label_loc_weight, gt_mask = prepare_batch(data, device)
        with amp.autocast(enabled=cfg["train"]["amp"]):  # expect: AMP009
            cls, loc, mask_logits = model(template, search)
            cls_loss = select_cls_loss(cls, label_cls)
            loc_loss = weight_l1_loss(loc, label_loc, label_loc_weight)
            mask_prob = torch.sigmoid(mask_logits)
            # written out by hand: F.binary_cross_entropy refuses to run under autocast
            mask_loss = -(gt_mask * torch.log(mask_prob + 1e-8) + (1 - gt_mask) * torch.log(1 - mask_prob + 1e-8))  # expect: AMP011
            mask_loss = mask_loss.mean()
            loss = w["cls"] * cls_loss + w["loc"] * loc_loss + w["mask"] * mask_loss
            scaler.scale(loss).backward()  # expect: AMP008
        grad_norm = optimizer_step(model, optimizer, scaler, cfg["train"]["grad_clip"])
        if it % cfg["train"]["log_every"] == 0:
            logger.info("epoch %d iter %d | cls %.4f loc %.4f mask %.4f | grad %s | %.3fs/it", epoch, it,
                        float(cls_loss), loc_loss.item(), mask_loss.item(), grad_norm, time.time() - end)
        end = time.time()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    total, n = 0.0, 0
    for data in loader:
        template, search = data["template"].to(device), data["search"].to(device)
        cls, loc, _ = model(template, search)
        total += float(select_cls_loss(cls, data["label_cls"].to(device)))
        total += weight_l1_loss(loc, data["label_loc"].to(device), data["label_loc_weight"].to(device)).item()
        n += 1
    return total / max(n, 1)


class SiamTracker:
    """Online tracker: fp16 weights, cosine window and scale-change penalty (SiamRPN)."""

    def __init__(self, model, cfg):
        self.model = model.half().eval()
        self.cfg = cfg["track"]
        hanning = np.hanning(self.cfg["score_size"])
        self.window = np.tile(np.outer(hanning, hanning).flatten(), cfg["anchor"]["num"])
        self.center_pos, self.size = None, None

    @torch.no_grad()
    def init(self, z_crop, bbox):
        self.center_pos = np.array([bbox[0] + (bbox[2] - 1) / 2, bbox[1] + (bbox[3] - 1) / 2])
        self.size = np.array([bbox[2], bbox[3]])
        self.model.template(z_crop.cuda().half())

    @torch.no_grad()
    def track(self, x_crop, scale_z):
        cls, loc = self.model.track(x_crop.cuda().half())
        score = torch.sigmoid(cls).permute(1, 2, 3, 0).contiguous().view(-1).float().cpu().numpy()
        delta = loc.permute(1, 2, 3, 0).contiguous().view(4, -1).float().cpu().numpy()
        penalty = np.exp(-(np.abs(delta[2] - delta[3])) * self.cfg["penalty_k"])
        pscore = penalty * score * (1 - self.cfg["window_influence"]) + self.window * self.cfg["window_influence"]
        best = int(np.argmax(pscore))
        lr = penalty[best] * score[best] * self.cfg["lr"]
        self.size = self.size * (1 - lr) + np.exp(delta[2:, best]) * self.size * lr
        self.center_pos = self.center_pos + delta[:2, best] / scale_z
        return {"bbox": [*(self.center_pos - self.size / 2), *self.size], "best_score": float(score[best])}


def main():
    parser = argparse.ArgumentParser(description="siammask-lite training")
    parser.add_argument("--cfg", type=str, default="")
    parser.add_argument("--resume", type=str, default="")
    args = parser.parse_args()
    cfg = DEFAULT_CFG
    if args.cfg:
        with open(args.cfg) as f:
            cfg = yaml.safe_load(f)
    device = torch.device("cuda")
    from pysot_lite.datasets import build_loaders  # noqa: E402  (heavy import: cv2, lmdb)

    train_loader, val_loader = build_loaders(cfg)
    model = SiamMaskLite(cfg["anchor"]["num"]).to(device)
    scaler = build_scaler(cfg)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
    best = float("inf")
    os.makedirs(cfg["train"]["snapshot_dir"], exist_ok=True)
    for epoch in range(start_epoch, cfg["train"]["epochs"]):
        optimizer = build_optimizer(model, cfg, epoch)
        train_one_epoch(model, train_loader, optimizer, scaler, cfg, epoch, device)
        val = validate(model, val_loader, device)
        state = {"epoch": epoch, "state_dict": model.state_dict(), "scaler": scaler.state_dict()}
        torch.save(state, os.path.join(cfg["train"]["snapshot_dir"], f"checkpoint_e{epoch}.pth"))
        if val < best:
            best = val
            torch.save(state, os.path.join(cfg["train"]["snapshot_dir"], "best.pth"))


if __name__ == "__main__":
    main()
