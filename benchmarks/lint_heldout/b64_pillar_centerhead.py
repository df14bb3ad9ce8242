"""Pillar-based 3D object detector with a CenterPoint-style heatmap head.

Points -> pillars (PointPillars feature net) -> BEV pseudo-image -> 2D backbone/neck
-> per-class center heatmaps and box regression. Trains in bf16 autocast (A100/H100),
so no loss scaling is used.
"""
import argparse
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from det3d.datasets import build_dataset, collate_batch
from det3d.targets import CenterTargetAssigner
from det3d.utils import save_checkpoint, setup_logger

logger = logging.getLogger(__name__)


@dataclass
class DetectorConfig:
    point_range: tuple = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)
    pillar_size: tuple = (0.2, 0.2, 8.0)
    pfn_channels: tuple = (64, 64)
    pfn_pool: str = "mean"
    backbone_channels: tuple = (64, 128, 256)
    backbone_layers: tuple = (3, 5, 5)
    neck_channels: int = 128
    use_se: bool = True
    num_classes: int = 10
    head_channels: int = 64
    heads: dict = field(default_factory=lambda: {"reg": 2, "height": 1, "dim": 3, "rot": 2})


class PFNLayer(nn.Module):
    """Point-wise linear + pooled pillar feature, concatenated for the next layer."""

    def __init__(self, in_ch, out_ch, last_layer=False, pool="mean"):
        super().__init__()
        self.last = last_layer
        self.pool = pool
        self.linear = nn.Linear(in_ch, out_ch if last_layer else out_ch // 2)

    def forward(self, inputs, point_mask):
        x = F.relu(self.linear(inputs))
        x = x.masked_fill(~point_mask.unsqueeze(-1), 0.0)
        if self.pool == "max":
            x_pool = x.max(dim=1, keepdim=True)[0]
        else:
            x_pool = x.mean(dim=1, keepdim=True)  # expect: AMP004
        if self.last:
            return x_pool.squeeze(1)
        return torch.cat([x, x_pool.expand_as(x)], dim=2)


class PillarFeatureNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        in_ch = 4 + 5  # x, y, z, r + cluster offsets (3) + center offsets (2)
        chans = [in_ch, *cfg.pfn_channels]
        self.pfn_layers = nn.ModuleList(
            PFNLayer(chans[i], chans[i + 1], last_layer=(i == len(chans) - 2), pool=cfg.pfn_pool)
            for i in range(len(chans) - 1)
        )
        self.vx, self.vy = cfg.pillar_size[0], cfg.pillar_size[1]
        self.x_offset = self.vx / 2 + cfg.point_range[0]
        self.y_offset = self.vy / 2 + cfg.point_range[1]

    def forward(self, points, num_points, coords):
        # points: [P, N, 4]; num_points: [P]; coords: [P, 4] (batch, z, y, x)
        point_mask = torch.arange(points.size(1), device=points.device)[None] < num_points[:, None]
        points_mean = points[:, :, :3].sum(dim=1, keepdim=True) / num_points.clamp(min=1).view(-1, 1, 1)
        f_cluster = points[:, :, :3] - points_mean
        f_center = torch.zeros_like(points[:, :, :2])
        f_center[:, :, 0] = points[:, :, 0] - (coords[:, 3:4].to(points.dtype) * self.vx + self.x_offset)
        f_center[:, :, 1] = points[:, :, 1] - (coords[:, 2:3].to(points.dtype) * self.vy + self.y_offset)
        features = torch.cat([points, f_cluster, f_center], dim=-1)
        for pfn in self.pfn_layers:
            features = pfn(features, point_mask)
        return features


class PointPillarsScatter(nn.Module):
    def __init__(self, channels, grid_size):
        super().__init__()
        self.channels = channels
        self.nx, self.ny = grid_size

    def forward(self, pillar_features, coords, batch_size):
        canvases = []
        for b in range(batch_size):
            sel = coords[:, 0] == b
            canvas = torch.zeros(self.channels, self.nx * self.ny,
                                 dtype=pillar_features.dtype, device=pillar_features.device)
            idx = (coords[sel, 2] * self.nx + coords[sel, 3]).long()
            canvas[:, idx] = pillar_features[sel].t()
            canvases.append(canvas.view(self.channels, self.ny, self.nx))
        return torch.stack(canvases, dim=0)


class SEBlock(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


def conv_bn_relu(in_ch, out_ch, stride=1):
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_ch, eps=1e-3, momentum=0.01),
        nn.ReLU(inplace=True),
    )


class BEVBackbone(nn.Module):
    def __init__(self, in_ch, cfg):
        super().__init__()
        self.blocks = nn.ModuleList()
        self.deblocks = nn.ModuleList()
        c_in = in_ch
        for i, (c, n) in enumerate(zip(cfg.backbone_channels, cfg.backbone_layers)):
            layers = [conv_bn_relu(c_in, c, stride=1 if i == 0 else 2)]
            layers += [conv_bn_relu(c, c) for _ in range(n)]
            self.blocks.append(nn.Sequential(*layers))
            up = 2 ** i
            self.deblocks.append(nn.Sequential(
                nn.ConvTranspose2d(c, cfg.neck_channels, up, stride=up, bias=False),
                nn.BatchNorm2d(cfg.neck_channels, eps=1e-3, momentum=0.01),
                nn.ReLU(inplace=True),
            ))
            c_in = c
        fused = cfg.neck_channels * len(cfg.backbone_channels)
        self.fuse = nn.Conv2d(fused, fused, 1)
        self.se = SEBlock(fused) if cfg.use_se else nn.Identity()
        self.out_channels = fused

    def forward(self, x):
        ups = []
        for block, deblock in zip(self.blocks, self.deblocks):
            x = block(x)
            ups.append(deblock(x))
        x = self.fuse(torch.cat(ups, dim=1))
        return self.se(x)


class CenterHead(nn.Module):
    def __init__(self, in_ch, cfg):
        super().__init__()
        self.shared = conv_bn_relu(in_ch, cfg.head_channels)
        outputs = {"heatmap": cfg.num_classes, **cfg.heads}
        self.branches = nn.ModuleDict({
            name: nn.Sequential(
                nn.Conv2d(cfg.head_channels, cfg.head_channels, 3, padding=1),
                nn.ReLU(inplace=True),
                nn.Conv2d(cfg.head_channels, out_ch, 1),
            )
            for name, out_ch in outputs.items()
        })
        self.branches["heatmap"][-1].bias.data.fill_(-2.19)

    def forward(self, x):
        x = self.shared(x)
        return {name: branch(x) for name, branch in self.branches.items()}


class PillarCenterNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        nx = round((cfg.point_range[3] - cfg.point_range[0]) / cfg.pillar_size[0])
        ny = round((cfg.point_range[4] - cfg.point_range[1]) / cfg.pillar_size[1])
        self.pfn = PillarFeatureNet(cfg)
        self.scatter = PointPillarsScatter(cfg.pfn_channels[-1], (nx, ny))
        self.backbone = BEVBackbone(cfg.pfn_channels[-1], cfg)
        self.head = CenterHead(self.backbone.out_channels, cfg)

    def forward(self, batch):
        pillars = self.pfn(batch["pillars"], batch["num_points"], batch["coords"])
        bev = self.scatter(pillars, batch["coords"], batch["batch_size"])
        return self.head(self.backbone(bev))


class GaussianFocalLoss(nn.Module):
    """CornerNet/CenterNet focal loss on gaussian-splatted heatmaps."""

    def __init__(self, alpha=2.0, gamma=4.0):
        super().__init__()
        self.alpha = alpha
        self.gamma = gamma

    def forward(self, logits, target):
        pred = torch.sigmoid(logits.float()).clamp(1e-4, 1 - 1e-4)
        pos = target.eq(1).float()
        neg_weights = torch.pow(1 - target, self.gamma)
        pos_loss = torch.log(pred) * torch.pow(1 - pred, self.alpha) * pos
        neg_loss = torch.log(1 - pred) * torch.pow(pred, self.alpha) * neg_weights * (1 - pos)
        num_pos = pos.sum().clamp(min=1.0)
        return -(pos_loss.sum() + neg_loss.sum()) / num_pos


class RegL1Loss(nn.Module):
    def forward(self, output, mask, ind, target):
        b, c = output.shape[:2]
        feat = output.view(b, c, -1).permute(0, 2, 1)
        pred = feat.gather(1, ind.unsqueeze(-1).expand(-1, -1, c)).float()
        m = mask.unsqueeze(-1).float()
        loss = F.l1_loss(pred * m, target * m, reduction="sum")
        return loss / (m.sum() * c + 1e-4)


def compute_losses(preds, targets, focal, reg_l1, weights):
    losses = {"hm": focal(preds["heatmap"], targets["heatmap"])}
    for name in ("reg", "height", "dim", "rot"):
        losses[name] = reg_l1(preds[name], targets["mask"], targets["ind"], targets[name])
    losses["total"] = sum(weights.get(k, 1.0) * v for k, v in losses.items())
    return losses


def train_one_epoch(model, loader, assigner, optimizer, scheduler, epoch, args):
    model.train()
    focal, reg_l1 = GaussianFocalLoss(), RegL1Loss()
    weights = {"hm": 1.0, "reg": 2.0, "height": 1.0, "dim": 1.0, "rot": 1.0}
    t0 = time.time()
    for it, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        targets = assigner.assign(batch["gt_boxes"], batch["gt_labels"])

        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = model(batch)
            losses = compute_losses(preds, targets, focal, reg_l1, weights)
            with torch.no_grad():
                hm_mean = preds["heatmap"].sigmoid().mean()  # expect: AMP004

        optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        optimizer.step()
        scheduler.step()

        if it % args.log_every == 0:
            logger.info(
                "ep %d it %d  total %.4f  hm %.4f  hm_mean %.4f  |g| %.2f  %.2fs/it",
                epoch, it, losses["total"].item(), losses["hm"].item(), hm_mean.item(),
                grad_norm.item(), (time.time() - t0) / (it + 1),
            )


def profile_step(model, loader, assigner, steps=20):
    """Rough per-iteration timing of forward+backward in bf16."""
    model.train()
    focal, reg_l1 = GaussianFocalLoss(), RegL1Loss()
    batch = next(iter(loader))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    targets = assigner.assign(batch["gt_boxes"], batch["gt_labels"])
    torch.cuda.synchronize()
    start = time.time()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = model(batch)
            loss = compute_losses(preds, targets, focal, reg_l1, {})["total"]
            loss.backward()  # expect: AMP008
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.time() - start) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--work-dir", default="work_dirs/pillar_center")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip-norm", type=float, default=35.0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    setup_logger(args.work_dir)

    cfg = DetectorConfig()
    dataset = build_dataset(args.data_root, split="train", point_range=cfg.point_range,
                            pillar_size=cfg.pillar_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=8,
                        collate_fn=collate_batch, pin_memory=True, drop_last=True)
    assigner = CenterTargetAssigner(cfg, out_stride=1)

    model = PillarCenterNet(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader), pct_start=0.4
    )

    if args.profile:
        logger.info("%.3f s/it", profile_step(model, loader, assigner))
        return

    for epoch in range(args.epochs):
        train_one_epoch(model, loader, assigner, optimizer, scheduler, epoch, args)
        save_checkpoint(model, optimizer, epoch, os.path.join(args.work_dir, f"epoch_{epoch}.pth"))


if __name__ == "__main__":
    main()
