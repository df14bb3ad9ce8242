"""Anchor-free 3D detection on BEV feature maps (CenterPoint-style heads).

Multi-sweep BEV features are fused, passed through a light 2D backbone and
decoded by one separate head per class group: a Gaussian heatmap plus
regression maps for offset, height, size, yaw, velocity and an IoU score.
"""
import argparse
import copy
import glob
import os
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class HeadConfig:
    share_channels: int = 64
    tasks: Sequence[Sequence[str]] = (
        ("car",),
        ("truck", "construction_vehicle"),
        ("bus", "trailer"),
        ("barrier",),
        ("motorcycle", "bicycle"),
        ("pedestrian", "traffic_cone"),
    )
    common_heads: Dict[str, Tuple[int, int]] = field(
        default_factory=lambda: {
            "reg": (2, 2), "height": (1, 2), "dim": (3, 2),
            "rot": (2, 2), "vel": (2, 2), "iou": (1, 2),
        }
    )
    code_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2)
    loc_weight: float = 0.25


def conv_bn_relu(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01),
        nn.ReLU(inplace=True),
    )


class TemporalFusion(nn.Module):
    """Aligns the BEV maps of the last sweeps with a shared conv and averages them."""

    def __init__(self, channels):
        super().__init__()
        self.align = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, bev):
        b, t = bev.shape[:2]
        aligned = self.align(bev.flatten(0, 1)).unflatten(0, (b, t))
        fused = aligned.mean(dim=1)  # expect: AMP004
        return F.relu(fused)


class ContextSE(nn.Module):
    """Channel re-weighting from a global scene context vector."""

    def __init__(self, channels, reduction=8):
        super().__init__()
        self.proj = nn.Conv2d(channels, channels, 1)
        self.fc1 = nn.Linear(channels, channels // reduction)
        self.fc2 = nn.Linear(channels // reduction, channels)

    def forward(self, x):
        ctx = self.proj(x)
        pooled = ctx.mean(dim=(2, 3))  # expect: AMP004
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(pooled))))
        return x * w[:, :, None, None]


class BEVBackbone(nn.Module):
    def __init__(self, in_channels=64, layer_nums=(3, 5), strides=(1, 2),
                 filters=(128, 256), up_strides=(1, 2), up_filters=(192, 192)):
        super().__init__()
        self.blocks = nn.ModuleList()
        self.deblocks = nn.ModuleList()
        cin = in_channels
        for i, n in enumerate(layer_nums):
            layers = [conv_bn_relu(cin, filters[i], stride=strides[i])]
            layers += [conv_bn_relu(filters[i], filters[i]) for _ in range(n)]
            self.blocks.append(nn.Sequential(*layers))
            self.deblocks.append(nn.Sequential(
                nn.ConvTranspose2d(filters[i], up_filters[i], up_strides[i], stride=up_strides[i], bias=False),
                nn.BatchNorm2d(up_filters[i], eps=1e-3, momentum=0.01),
                nn.ReLU(inplace=True),
            ))
            cin = filters[i]
        self.context = ContextSE(sum(up_filters))
        self.out_channels = sum(up_filters)

    def forward(self, x):
        ups = []
        for block, deblock in zip(self.blocks, self.deblocks):
            x = block(x)
            ups.append(deblock(x))
        return self.context(torch.cat(ups, dim=1))


class SepHead(nn.Module):
    def __init__(self, in_channels, heads, head_conv=64, final_kernel=3, init_bias=-2.19):
        super().__init__()
        self.heads = nn.ModuleDict()
        for name, (out_ch, num_conv) in heads.items():
            layers, c = [], in_channels
            for _ in range(num_conv - 1):
                layers += [
                    nn.Conv2d(c, head_conv, final_kernel, padding=final_kernel // 2, bias=False),
                    nn.BatchNorm2d(head_conv),
                    nn.ReLU(inplace=True),
                ]
                c = head_conv
            layers.append(nn.Conv2d(c, out_ch, final_kernel, padding=final_kernel // 2, bias=True))
            head = nn.Sequential(*layers)
            if name == "heatmap":
                head[-1].bias.data.fill_(init_bias)
            else:
                for m in head.modules():
                    if isinstance(m, nn.Conv2d):
                        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            self.heads[name] = head

    def forward(self, x):
        return {name: head(x) for name, head in self.heads.items()}


def _gather_feat(feat, ind):
    dim = feat.size(2)
    ind = ind.unsqueeze(2).expand(ind.size(0), ind.size(1), dim)
    return feat.gather(1, ind)


def _transpose_and_gather_feat(feat, ind):
    feat = feat.permute(0, 2, 3, 1).contiguous()
    feat = feat.view(feat.size(0), -1, feat.size(3))
    return _gather_feat(feat, ind)


class GaussianFocalLoss(nn.Module):
    """Penalty-reduced pixel-wise focal loss on rendered Gaussian heatmaps."""

    def __init__(self, alpha=2.0, gamma=4.0):
        super().__init__()
        self.alpha = alpha
        self.gamma = gamma

    def forward(self, logits, target):
        pred = logits.sigmoid()
        pos_mask = target.eq(1).float()
        neg_mask = 1.0 - pos_mask
        neg_weights = torch.pow(1 - target, self.gamma)
        pos_loss = torch.log(pred + 1e-12) * torch.pow(1 - pred, self.alpha) * pos_mask  # expect: AMP011
        neg_loss = torch.log(1 - pred + 1e-12) * torch.pow(pred, self.alpha) * neg_weights * neg_mask  # expect: AMP011
        num_pos = pos_mask.sum()
        pos_loss = pos_loss.sum()
        neg_loss = neg_loss.sum()
        if num_pos == 0:
            return -neg_loss
        return -(pos_loss + neg_loss) / num_pos


class RegL1Loss(nn.Module):
    def forward(self, output, mask, ind, target):
        pred = _transpose_and_gather_feat(output, ind)
        mask = mask.float().unsqueeze(2)
        loss = F.l1_loss(pred * mask, target * mask, reduction="none")
        loss = loss / (mask.sum() + 1e-4)
        return loss.transpose(2, 0).sum(dim=2).sum(dim=1)


class CenterHead(nn.Module):
    def __init__(self, cfg: HeadConfig, in_channels):
        super().__init__()
        self.class_names = [list(t) for t in cfg.tasks]
        self.shared_conv = nn.Sequential(
            nn.Conv2d(in_channels, cfg.share_channels, 3, padding=1, bias=True),
            nn.BatchNorm2d(cfg.share_channels),
            nn.ReLU(inplace=True),
        )
        self.task_heads = nn.ModuleList()
        for names in cfg.tasks:
            heads = copy.deepcopy(dict(cfg.common_heads))
            heads["heatmap"] = (len(names), 2)
            self.task_heads.append(SepHead(cfg.share_channels, heads))
        self.crit = GaussianFocalLoss()
        self.crit_reg = RegL1Loss()
        self.register_buffer("code_weights", torch.tensor(cfg.code_weights))
        self.loc_weight = cfg.loc_weight

    def forward(self, x):
        x = self.shared_conv(x)
        return [head(x) for head in self.task_heads]

    def loss(self, preds_dicts, targets):
        log_vars, total = {}, 0.0
        for task_id, preds in enumerate(preds_dicts):
            mask, ind = targets["masks"][task_id], targets["inds"][task_id]
            hm_loss = self.crit(preds["heatmap"], targets["heatmaps"][task_id])
            box_pred = torch.cat([preds["reg"], preds["height"], preds["dim"], preds["rot"], preds["vel"]], dim=1)
            box_loss = self.crit_reg(box_pred, mask, ind, targets["anno_boxes"][task_id])
            loc_loss = (box_loss * self.code_weights).sum()

            iou_pred = _transpose_and_gather_feat(preds["iou"], ind).squeeze(-1)
            iou_mask = mask.float()
            iou_loss = F.binary_cross_entropy(iou_pred.sigmoid(), targets["ious"][task_id], reduction="none")  # expect: AMP003
            iou_loss = (iou_loss * iou_mask).sum() / (iou_mask.sum() + 1e-4)

            total = total + hm_loss + self.loc_weight * loc_loss + iou_loss
            with torch.no_grad():
                log_vars[f"task{task_id}.hm_loss"] = hm_loss.detach()
                log_vars[f"task{task_id}.loc_loss"] = loc_loss.detach()
                log_vars[f"task{task_id}.hm_mean"] = preds["heatmap"].sigmoid().mean()  # expect: AMP004
                log_vars[f"task{task_id}.num_pos"] = iou_mask.sum()
        log_vars["loss"] = total
        return log_vars


class CenterPointBEV(nn.Module):
    def __init__(self, head_cfg: HeadConfig, in_channels=64):
        super().__init__()
        self.temporal = TemporalFusion(in_channels)
        self.backbone = BEVBackbone(in_channels)
        self.head = CenterHead(head_cfg, self.backbone.out_channels)

    def forward(self, bev_sweeps):
        return self.head(self.backbone(self.temporal(bev_sweeps)))

    def loss(self, preds, targets):
        return self.head.loss(preds, targets)


MODELS = {"centerpoint_bev": CenterPointBEV}


def build_model(args):
    return MODELS[args.arch](HeadConfig(), in_channels=args.bev_channels)


@torch.no_grad()
def decode_heatmaps(preds_dicts, k=500, score_thresh=0.1):
    results = []
    for preds in preds_dicts:
        heat = preds["heatmap"].float().sigmoid()
        hmax = F.max_pool2d(heat, 3, stride=1, padding=1)
        heat = heat * (hmax == heat).float()
        b, c, h, w = heat.shape
        scores, inds = heat.view(b, -1).topk(k)
        classes = torch.div(inds, h * w, rounding_mode="floor")
        pix = inds % (h * w)
        keep = scores > score_thresh
        results.append({"scores": scores, "classes": classes, "pix": pix, "keep": keep,
                        "mean_score": scores.mean(dim=1)})
    return results


class BEVSweepDataset(Dataset):
    def __init__(self, root, num_tasks):
        self.files = sorted(glob.glob(os.path.join(root, "*.npz")))
        self.num_tasks = num_tasks

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        data = np.load(self.files[idx])
        sample = {"bev": torch.from_numpy(data["bev"]).float(), "targets": {}}
        for key in ("heatmaps", "anno_boxes", "inds", "masks", "ious"):
            sample["targets"][key] = [torch.from_numpy(data[f"{key}_{t}"]) for t in range(self.num_tasks)]
        return sample


def train_one_epoch(model, loader, optimizer, scheduler, scaler, epoch, args):
    model.train()
    core = model.module if isinstance(model, DDP) else model
    for it, batch in enumerate(loader):
        bev = batch["bev"].cuda(non_blocking=True)
        targets = {k: [t.cuda(non_blocking=True) for t in v] for k, v in batch["targets"].items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            preds = model(bev)
            log_vars = core.loss(preds, targets)
        loss = log_vars["loss"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if it % args.log_interval == 0 and dist.get_rank() == 0:
            msg = " ".join(f"{k}={float(v):.4f}" for k, v in log_vars.items())
            print(f"epoch {epoch} iter {it} {msg} grad_norm={float(grad_norm):.3f} scale={scaler.get_scale():.0f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/nusc_bev")
    parser.add_argument("--arch", default="centerpoint_bev")
    parser.add_argument("--bev-channels", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--grad-clip", type=float, default=35.0)
    parser.add_argument("--log-interval", type=int, default=50)
    args = parser.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    dataset = BEVSweepDataset(args.data, num_tasks=len(HeadConfig().tasks))
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    model = build_model(args).cuda()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader), pct_start=0.4)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(model, loader, optimizer, scheduler, scaler, epoch, args)
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), f"centerpoint_e{epoch}.pth")


if __name__ == "__main__":
    main()
