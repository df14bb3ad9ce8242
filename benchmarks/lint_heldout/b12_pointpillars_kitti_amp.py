"""PointPillars on KITTI (car class), trimmed from an OpenPCDet-style codebase into one trainer.

    python train_pointpillars.py --cfg cfgs/pointpillar_car.yaml            # fp16 autocast by default
"""

import argparse
import logging
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.utils import clip_grad_norm_

from pcdet_lite.datasets import build_kitti_loader
from pcdet_lite.eval import kitti_eval
from pcdet_lite.ops import decode_boxes, nms_bev

log = logging.getLogger("pointpillars")


class PillarScatterFunction(torch.autograd.Function):
    """Scatter pillar features onto the BEV canvas (written as a Function for memory)."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, pillar_features, coords, batch_size, ny, nx):
        channels = pillar_features.shape[1]
        canvas = pillar_features.new_zeros(batch_size, channels, ny * nx)
        flat_idx = coords[:, 2] * nx + coords[:, 3]
        canvas[coords[:, 0], :, flat_idx] = pillar_features
        ctx.save_for_backward(coords)
        ctx.grid = (ny, nx)
        return canvas.view(batch_size, channels, ny, nx)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_canvas):
        (coords,) = ctx.saved_tensors
        ny, nx = ctx.grid
        b, c = grad_canvas.shape[:2]
        flat_idx = coords[:, 2] * nx + coords[:, 3]
        grad_features = grad_canvas.reshape(b, c, ny * nx)[coords[:, 0], :, flat_idx]
        return grad_features, None, None, None, None


class PillarFeatureNet(nn.Module):
    def __init__(self, in_channels=4, out_channels=64, voxel_size=(0.16, 0.16, 4), pc_range=(0, -39.68, -3)):
        super().__init__()
        self.linear = nn.Linear(in_channels + 5, out_channels, bias=False)
        self.norm = nn.BatchNorm1d(out_channels, eps=1e-3, momentum=0.01)
        self.vx, self.vy = voxel_size[0], voxel_size[1]
        self.x_offset = voxel_size[0] / 2 + pc_range[0]
        self.y_offset = voxel_size[1] / 2 + pc_range[1]

    def forward(self, voxels, num_points, coords):
        points_mean = voxels[:, :, :3].sum(dim=1, keepdim=True) / num_points.view(-1, 1, 1).clamp(min=1)
        f_cluster = voxels[:, :, :3] - points_mean
        f_center = torch.zeros_like(voxels[:, :, :2])
        f_center[:, :, 0] = voxels[:, :, 0] - (coords[:, 3:4] * self.vx + self.x_offset)
        f_center[:, :, 1] = voxels[:, :, 1] - (coords[:, 2:3] * self.vy + self.y_offset)
        features = torch.cat([voxels, f_cluster, f_center], dim=-1)
        point_idx = torch.arange(voxels.shape[1], device=voxels.device).view(1, -1)
        mask = (point_idx < num_points.view(-1, 1)).unsqueeze(-1)
        features = features * mask
        x = self.linear(features)
        x = self.norm(x.permute(0, 2, 1)).permute(0, 2, 1)
        x = F.relu(x)
        return x.max(dim=1)[0]


class ChannelAttention(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc1 = nn.Linear(channels, channels // reduction)
        self.fc2 = nn.Linear(channels // reduction, channels)

    def forward(self, x):
        w = x.mean(dim=(2, 3))  # expect: AMP004
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(w))))
        return x * w[:, :, None, None]


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


class BEVBackbone(nn.Module):
    def __init__(self, cin=64, layers=(3, 5, 5), channels=(64, 128, 256), up=(128, 128, 128)):
        super().__init__()
        self.blocks, self.deblocks = nn.ModuleList(), nn.ModuleList()
        for i, (n, c) in enumerate(zip(layers, channels)):
            block = [conv_bn(cin, c, stride=2)] + [conv_bn(c, c) for _ in range(n)]
            self.blocks.append(nn.Sequential(*block))
            self.deblocks.append(nn.Sequential(
                nn.ConvTranspose2d(c, up[i], 2 ** i, 2 ** i, bias=False),
                nn.BatchNorm2d(up[i], eps=1e-3, momentum=0.01), nn.ReLU()))
            cin = c
        self.fuse = nn.Conv2d(sum(up), sum(up), 1)
        self.attention = ChannelAttention(sum(up))

    def forward(self, x):
        ups = []
        for block, deblock in zip(self.blocks, self.deblocks):
            x = block(x)
            ups.append(deblock(x))
        return self.attention(self.fuse(torch.cat(ups, dim=1)))


class PointPillars(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nx, self.ny = cfg["grid"]
        self.pfn = PillarFeatureNet(voxel_size=cfg["voxel_size"], pc_range=cfg["pc_range"])
        self.backbone = BEVBackbone()
        a = cfg["anchors_per_loc"]
        self.cls_head = nn.Conv2d(384, a, 1)
        self.box_head = nn.Conv2d(384, a * 7, 1)
        self.dir_head = nn.Conv2d(384, a * 2, 1)
        nn.init.constant_(self.cls_head.bias, -np.log((1 - 0.01) / 0.01))

    def forward(self, voxels, coords, num_points, batch_size):
        pillars = self.pfn(voxels, num_points, coords)
        bev = PillarScatterFunction.apply(pillars, coords, batch_size, self.ny, self.nx)
        feats = self.backbone(bev)
        return self.cls_head(feats), self.box_head(feats), self.dir_head(feats)


class PointPillarsLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0, box_weight=2.0, dir_weight=0.2):
        super().__init__()
        self.alpha, self.gamma = alpha, gamma
        self.box_weight, self.dir_weight = box_weight, dir_weight

    def focal(self, logits, targets, weights):
        p = torch.sigmoid(logits)
        log_p = torch.log(p + 1e-8)  # expect: AMP011
        log_1mp = torch.log(1 - p + 1e-8)  # expect: AMP011
        pos_term = self.alpha * targets * (1 - p) ** self.gamma * log_p
        neg_term = (1 - self.alpha) * (1 - targets) * p ** self.gamma * log_1mp
        return (-(pos_term + neg_term) * weights).sum()

    def forward(self, cls_preds, box_preds, dir_preds, targets):
        b = cls_preds.shape[0]
        cls_preds = cls_preds.permute(0, 2, 3, 1).reshape(b, -1)
        box_preds = box_preds.permute(0, 2, 3, 1).reshape(b, -1, 7)
        dir_preds = dir_preds.permute(0, 2, 3, 1).reshape(b, -1, 2)
        labels, pos = targets["labels"].float(), targets["labels"] > 0
        num_pos = pos.sum().clamp(min=1).float()
        cls_weights = (targets["labels"] >= 0).float() / num_pos
        cls_loss = self.focal(cls_preds, labels.clamp(min=0), cls_weights)
        box_loss = F.smooth_l1_loss(box_preds[pos], targets["box_targets"][pos], beta=1 / 9, reduction="sum") / num_pos
        dir_loss = F.cross_entropy(dir_preds[pos], targets["dir_targets"][pos], reduction="sum") / num_pos
        total = cls_loss + self.box_weight * box_loss + self.dir_weight * dir_loss
        return total, {"cls": cls_loss.item(), "box": box_loss.item(), "dir": dir_loss.item()}


def load_batch_to_gpu(batch, device):
    voxels = batch["voxels"].to(device, non_blocking=True).half()  # expect: AMP001
    coords = batch["coords"].to(device, non_blocking=True).long()
    num_points = batch["num_points"].to(device, non_blocking=True)
    targets = {k: v.to(device, non_blocking=True) for k, v in batch["targets"].items()}
    return voxels, coords, num_points, targets


def build_amp(cfg):
    if cfg.get("amp", False):
        return torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    return nullcontext(), None


def train_one_epoch(model, criterion, optimizer, scheduler, loader, amp_ctx, scaler, cfg, epoch):
    model.train()
    for it, batch in enumerate(loader):
        voxels, coords, num_points, targets = load_batch_to_gpu(batch, cfg["device"])
        with amp_ctx:
            cls_preds, box_preds, dir_preds = model(voxels, coords, num_points, batch["batch_size"])
        loss, parts = criterion(cls_preds, box_preds, dir_preds, targets)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            grad_norm = clip_grad_norm_(model.parameters(), cfg["grad_clip"])  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            grad_norm = clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optimizer.step()
        scheduler.step()
        if it % cfg["log_every"] == 0:
            log.info("epoch %d it %d loss %.4f %s gnorm %.2f lr %.2e", epoch, it, loss.item(), parts,
                     float(grad_norm), optimizer.param_groups[0]["lr"])


@torch.no_grad()
def evaluate(model, loader, amp_ctx, cfg):
    model.eval()
    det_annos = []
    for batch in loader:
        voxels, coords, num_points, _ = load_batch_to_gpu(batch, cfg["device"])
        with amp_ctx:
            cls_preds, box_preds, dir_preds = model(voxels, coords, num_points, batch["batch_size"])
        scores = torch.sigmoid(cls_preds.float()).flatten(1)
        boxes = decode_boxes(box_preds.float(), dir_preds.float(), cfg)
        for b in range(scores.shape[0]):
            keep = scores[b] > cfg["score_thresh"]
            kept = nms_bev(boxes[b][keep], scores[b][keep], cfg["nms_thresh"], max_out=100)
            det_annos.append({"frame_id": batch["frame_id"][b], "boxes": boxes[b][keep][kept].cpu().numpy(),
                              "scores": scores[b][keep][kept].cpu().numpy()})
    model.train()
    return kitti_eval(det_annos, loader.dataset.kitti_infos)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--no-amp", dest="amp", action="store_false")
    parser.add_argument("--out", default="output/pointpillars")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)
    cfg["amp"] = args.amp
    cfg["device"] = "cuda"
    os.makedirs(args.out, exist_ok=True)

    train_loader = build_kitti_loader(cfg, split="train")
    val_loader = build_kitti_loader(cfg, split="val")
    model = PointPillars(cfg).cuda()
    criterion = PointPillarsLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01, betas=(0.95, 0.99))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], div_factor=10,
                                                    total_steps=cfg["epochs"] * len(train_loader))
    amp_ctx, scaler = build_amp(cfg)
    best_ap = -1.0
    for epoch in range(cfg["epochs"]):
        train_one_epoch(model, criterion, optimizer, scheduler, train_loader, amp_ctx, scaler, cfg, epoch)
        ap = evaluate(model, val_loader, amp_ctx, cfg)["Car_3d/moderate_R40"]
        log.info("epoch %d car 3d AP(mod) %.2f", epoch, ap)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None, "epoch": epoch},
                   os.path.join(args.out, "last.pth"))
        if ap > best_ap:
            best_ap = ap
            torch.save(model.state_dict(), os.path.join(args.out, "best.pth"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
