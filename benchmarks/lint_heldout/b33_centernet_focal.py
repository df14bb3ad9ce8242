"""CenterNet-style anchor-free detector: heatmap focal loss + size/offset L1.

Single- or multi-GPU (DDP) training with fp16 autocast, GradScaler and a
YOLOv5-style EMA of the weights.
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from coco_centernet import CenterNetDataset  # local: builds hm / wh / reg / ind / mask targets


class SqueezeExcite(nn.Module):
    def __init__(self, ch, rd_ratio=0.25):
        super().__init__()
        rd = max(8, int(ch * rd_ratio))
        self.fc1 = nn.Conv2d(ch, rd, 1)
        self.fc2 = nn.Conv2d(rd, ch, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.fc2(F.relu(self.fc1(s)))
        return x * s.sigmoid()


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, stride=1, use_se=False):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1)
        self.se = SqueezeExcite(cout) if use_se else nn.Identity()

    def forward(self, x):
        return self.se(F.silu(self.conv(x)))


class Backbone(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        chans = [width, width * 2, width * 4, width * 8, width * 16]
        self.stem = ConvBlock(3, chans[0], stride=2)
        self.stages = nn.ModuleList(
            [nn.Sequential(ConvBlock(a, b, stride=2), ConvBlock(b, b, use_se=i >= 2)) for i, (a, b) in enumerate(zip(chans[:-1], chans[1:]))]
        )
        self.out_channels = chans[2:]

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        return feats[1:]  # strides 8, 16, 32


class UpNeck(nn.Module):
    def __init__(self, in_channels, out_ch=128):
        super().__init__()
        self.lateral = nn.ModuleList([nn.Conv2d(c, out_ch, 1) for c in in_channels])
        self.smooth = nn.Conv2d(out_ch, out_ch, 3, padding=1)

    def forward(self, feats):
        x = self.lateral[-1](feats[-1])
        for lat, f in zip(reversed(self.lateral[:-1]), reversed(feats[:-1])):
            x = F.interpolate(x, size=f.shape[-2:], mode="nearest") + lat(f)
        return F.silu(self.smooth(x))


def _head(cin, cout, mid=64):
    return nn.Sequential(nn.Conv2d(cin, mid, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1))


class CenterHead(nn.Module):
    def __init__(self, in_ch, num_classes):
        super().__init__()
        self.hm = _head(in_ch, num_classes)
        self.wh = _head(in_ch, 2)
        self.reg = _head(in_ch, 2)
        nn.init.constant_(self.hm[-1].bias, -2.19)  # prior 0.1

    def forward(self, x):
        return {"hm": self.hm(x), "wh": self.wh(x), "reg": self.reg(x)}


class CenterNet(nn.Module):
    def __init__(self, num_classes=80, width=32):
        super().__init__()
        self.backbone = Backbone(width)
        self.neck = UpNeck(self.backbone.out_channels)
        self.head = CenterHead(128, num_classes)

    def forward(self, images):
        return self.head(self.neck(self.backbone(images)))


def build_model(cfg):
    return CenterNet(cfg.num_classes, cfg.width)


def transpose_and_gather_feat(feat, ind):
    B, C = feat.shape[:2]
    feat = feat.permute(0, 2, 3, 1).reshape(B, -1, C)
    return feat.gather(1, ind.unsqueeze(2).expand(-1, -1, C))


def reg_l1_loss(output, mask, ind, target):
    pred = transpose_and_gather_feat(output, ind)
    mask = mask.unsqueeze(2).expand_as(pred).float()
    loss = F.l1_loss(pred * mask, target * mask, reduction="sum")
    return loss / (mask.sum() + 1e-4)


class CenterNetLoss(nn.Module):
    def __init__(self, wh_weight=0.1, off_weight=1.0, alpha=2.0, beta=4.0):
        super().__init__()
        self.wh_weight, self.off_weight, self.alpha, self.beta = wh_weight, off_weight, alpha, beta

    def focal(self, pred, gt):
        pos = gt.eq(1).float()
        neg = gt.lt(1).float()
        neg_weights = torch.pow(1 - gt, self.beta)
        pos_loss = torch.log(pred + 1e-12) * torch.pow(1 - pred, self.alpha) * pos  # expect: AMP011
        neg_loss = torch.log(1 - pred + 1e-12) * torch.pow(pred, self.alpha) * neg_weights * neg  # expect: AMP011
        num_pos = pos.sum()
        pos_loss, neg_loss = pos_loss.sum(), neg_loss.sum()
        return -(pos_loss + neg_loss) / num_pos.clamp(min=1.0)

    def forward(self, outputs, batch):
        hm = torch.sigmoid(outputs["hm"])
        hm_loss = self.focal(hm, batch["hm"])
        wh_loss = reg_l1_loss(outputs["wh"], batch["mask"], batch["ind"], batch["wh"])
        off_loss = reg_l1_loss(outputs["reg"], batch["mask"], batch["ind"], batch["reg"])
        loss = hm_loss + self.wh_weight * wh_loss + self.off_weight * off_loss
        return {"loss": loss, "hm": hm_loss, "wh": wh_loss, "off": off_loss}


def de_parallel(model):
    return model.module if isinstance(model, DDP) else model


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000):
        self.ema = copy.deepcopy(de_parallel(model)).eval()
        self.updates = 0
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        with torch.no_grad():
            msd = de_parallel(model).state_dict()
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1 - d) * msd[k].detach()


def make_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


class Trainer:
    def __init__(self, cfg, local_rank=0):
        self.cfg = cfg
        self.device = torch.device("cuda", local_rank)
        model = build_model(cfg).to(self.device)
        if cfg.distributed:
            model = DDP(model, device_ids=[local_rank])
        self.model = model
        self.ema = ModelEMA(model)
        self.criterion = CenterNetLoss(wh_weight=cfg.wh_weight)
        self.optimizer = torch.optim.AdamW(de_parallel(model).parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scaler = make_scaler(cfg.amp)

    def train_step(self, batch):
        images = batch["image"].to(self.device, non_blocking=True)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if k != "image"}
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            outputs = self.model(images)
            losses = self.criterion(outputs, batch)
            self.scaler.scale(losses["loss"]).backward()  # expect: AMP008
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=35.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update(self.model)
        return {k: v.item() for k, v in losses.items()}

    @torch.no_grad()
    def decode(self, outputs, k=100):
        heat = outputs["hm"].float().sigmoid()
        hmax = F.max_pool2d(heat, 3, stride=1, padding=1)
        heat = heat * (hmax == heat).float()
        B, C, H, W = heat.shape
        scores, inds = heat.view(B, -1).topk(k)
        classes, inds = inds // (H * W), inds % (H * W)
        wh = transpose_and_gather_feat(outputs["wh"].float(), inds)
        return scores, classes, inds, wh

    def fit(self, loader, sampler, epochs):
        for epoch in range(epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            self.model.train()
            for it, batch in enumerate(loader):
                logs = self.train_step(batch)
                if it % 50 == 0 and (not self.cfg.distributed or dist.get_rank() == 0):
                    print(epoch, it, {k: f"{v:.3f}" for k, v in logs.items()})
            if not self.cfg.distributed or dist.get_rank() == 0:
                torch.save({"model": de_parallel(self.model).state_dict(), "ema": self.ema.ema.state_dict()}, f"centernet_{epoch}.pt")


def export_onnx(model, path, size=512):
    m = copy.deepcopy(de_parallel(model)).eval().half()
    dummy = torch.zeros(1, 3, size, size, device=next(m.parameters()).device).half()
    torch.onnx.export(m, dummy, path, opset_version=17, output_names=["hm", "wh", "reg"])


def gaussian_radius_targets(boxes, out_size):
    """numpy target assignment: min distance of each pixel to a box centre"""
    dist2 = np.full((len(boxes), out_size, out_size), 1e8, dtype=np.float32)
    for i, (cx, cy) in enumerate(boxes[:, :2]):
        ys, xs = np.mgrid[:out_size, :out_size]
        dist2[i] = (xs - cx) ** 2 + (ys - cy) ** 2
    return dist2.min(axis=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--num-classes", dest="num_classes", type=int, default=80)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--wh-weight", dest="wh_weight", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", dest="weight_decay", type=float, default=1e-4)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=140)
    p.add_argument("--amp", action="store_true")
    cfg = p.parse_args()
    cfg.distributed = "WORLD_SIZE" in os.environ
    local_rank = 0
    if cfg.distributed:
        dist.init_process_group("nccl")
        local_rank = dist.get_rank() % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
    dataset = CenterNetDataset(cfg.data, num_classes=cfg.num_classes)
    sampler = DistributedSampler(dataset) if cfg.distributed else None
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, shuffle=sampler is None, num_workers=8, drop_last=True)
    trainer = Trainer(cfg, local_rank)
    trainer.fit(loader, sampler, cfg.epochs)
    export_onnx(trainer.ema.ema, "centernet.onnx")


if __name__ == "__main__":
    main()
