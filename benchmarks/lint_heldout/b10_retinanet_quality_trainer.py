"""RetinaNet-style single-stage detector with an IoU-quality branch.

Trainer split in the detectron2 way: ``run_step`` loads a batch, assigns targets and runs
the forward under autocast; losses live in ``compute_losses`` so ATSS / GFL variants can override them.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import autocast, nn

logger = logging.getLogger(__name__)


@dataclass
class DetConfig:
    num_classes: int = 80
    fpn_channels: int = 128
    num_anchors: int = 9
    lr: float = 0.01
    weight_decay: float = 1e-4
    max_iter: int = 90_000
    amp: bool = True
    clip_norm: float = 10.0
    aux_weight: float = 0.25
    ema_decay: float = 0.9998
    log_period: int = 20
    out_dir: str = "output/retina_quality"
    milestones: List[int] = field(default_factory=lambda: [60_000, 80_000])


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class TinyBackbone(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.stem = conv_bn(3, width, 2)
        self.c3 = nn.Sequential(conv_bn(width, width * 2, 2), conv_bn(width * 2, width * 4, 2))
        self.c4 = conv_bn(width * 4, width * 8, 2)
        self.c5 = conv_bn(width * 8, width * 16, 2)
        self.out_channels = [width * 4, width * 8, width * 16]

    def forward(self, x):
        x = self.stem(x)
        c3 = self.c3(x)
        c4 = self.c4(c3)
        c5 = self.c5(c4)
        return [c3, c4, c5]


class FPN(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, out_channels, 1) for c in in_channels)
        self.output = nn.ModuleList(nn.Conv2d(out_channels, out_channels, 3, padding=1) for _ in in_channels)
        self.p6 = nn.Conv2d(out_channels, out_channels, 3, 2, 1)

    def forward(self, feats):
        laterals = [l(f) for l, f in zip(self.lateral, feats)]
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], size=laterals[i - 1].shape[-2:], mode="nearest")
        outs = [conv(l) for conv, l in zip(self.output, laterals)]
        outs.append(self.p6(outs[-1]))
        return outs


class QualityHead(nn.Module):
    def __init__(self, channels, num_anchors, num_classes):
        super().__init__()
        def tower():
            layers = []
            for _ in range(4):
                layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(32, channels), nn.ReLU(inplace=True)]
            return nn.Sequential(*layers)
        self.cls_tower, self.box_tower = tower(), tower()
        self.cls_logits = nn.Conv2d(channels, num_anchors * num_classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(channels, num_anchors * 4, 3, padding=1)
        self.quality = nn.Conv2d(channels, num_anchors, 3, padding=1)
        prior = 0.01
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - prior) / prior))
        self.num_classes = num_classes

    def forward(self, feats):
        cls, box, qual = [], [], []
        for f in feats:
            n = f.shape[0]
            c, b = self.cls_tower(f), self.box_tower(f)
            cls.append(self.cls_logits(c).permute(0, 2, 3, 1).reshape(n, -1, self.num_classes))
            box.append(self.bbox_pred(b).permute(0, 2, 3, 1).reshape(n, -1, 4))
            qual.append(self.quality(b).permute(0, 2, 3, 1).reshape(n, -1))
        return torch.cat(cls, 1), torch.cat(box, 1), torch.cat(qual, 1)


class RetinaQuality(nn.Module):
    def __init__(self, cfg: DetConfig):
        super().__init__()
        self.backbone = TinyBackbone()
        self.fpn = FPN(self.backbone.out_channels, cfg.fpn_channels)
        self.head = QualityHead(cfg.fpn_channels, cfg.num_anchors, cfg.num_classes)
        # dense auxiliary classifier on P3 only (anchor-free, one location per pixel)
        self.aux_cls = nn.Conv2d(cfg.fpn_channels, cfg.num_classes, 3, padding=1)

    def forward(self, images):
        feats = self.fpn(self.backbone(images))
        cls, box, qual = self.head(feats)
        aux = self.aux_cls(feats[0]).flatten(2).transpose(1, 2)
        return {"cls": cls, "box": box, "quality": qual, "aux_cls": aux}


def sigmoid_focal_loss(inputs, targets, alpha: float = 0.25, gamma: float = 2.0):
    p = torch.sigmoid(inputs)
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss


def giou_loss(pred, target, eps: float = 1e-7):
    x1, y1 = torch.max(pred[:, 0], target[:, 0]), torch.max(pred[:, 1], target[:, 1])
    x2, y2 = torch.min(pred[:, 2], target[:, 2]), torch.min(pred[:, 3], target[:, 3])
    inter = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    area_p = (pred[:, 2] - pred[:, 0]) * (pred[:, 3] - pred[:, 1])
    area_t = (target[:, 2] - target[:, 0]) * (target[:, 3] - target[:, 1])
    union = area_p + area_t - inter
    iou = inter / (union + eps)
    cx1, cy1 = torch.min(pred[:, 0], target[:, 0]), torch.min(pred[:, 1], target[:, 1])
    cx2, cy2 = torch.max(pred[:, 2], target[:, 2]), torch.max(pred[:, 3], target[:, 3])
    enclose = (cx2 - cx1) * (cy2 - cy1) + eps
    return 1 - iou + (enclose - union) / enclose, iou


def box_iou(a, b):
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area_a[:, None] + area_b[None] - inter)


class ModelEMA:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.module.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1 - self.decay)


class DetTrainer:
    def __init__(self, cfg: DetConfig, model: nn.Module, loader, anchors: torch.Tensor, p3_locations: int, device="cuda"):
        self.cfg = cfg
        self.p3_locations = p3_locations
        self.device = torch.device(device)
        self.model = model.to(self.device).to(memory_format=torch.channels_last)
        self.loader = loader
        self.anchors = anchors.to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(self.optimizer, cfg.milestones, 0.1)
        self.scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)  # expect: AMP009
        self.quality_loss = nn.BCELoss(reduction="sum")
        self.ema = ModelEMA(self.model, cfg.ema_decay)
        self.iter = 0

    def _load(self, batch):
        images = batch["images"].to(self.device, non_blocking=True).to(memory_format=torch.channels_last)
        boxes = [b.to(self.device) for b in batch["boxes"]]
        labels = [l.to(self.device) for l in batch["labels"]]
        return images, boxes, labels

    @torch.no_grad()
    def assign_targets(self, boxes, labels, image_hw):
        cls_t, box_t, fg = [], [], []
        h, w = image_hw
        inside = (self.anchors[:, 0] >= 0) & (self.anchors[:, 1] >= 0) & (self.anchors[:, 2] <= w) & (self.anchors[:, 3] <= h)
        for gt, lab in zip(boxes, labels):
            ious = box_iou(gt, self.anchors)
            ious[:, ~inside] = -1e9
            best, idx = ious.max(dim=0)
            t = torch.zeros(self.anchors.shape[0], self.cfg.num_classes, device=self.device)
            pos = best >= 0.5
            t[pos, lab[idx[pos]]] = 1.0
            cls_t.append(t)
            box_t.append(gt[idx])
            fg.append(pos)
        cls_t, box_t, fg = torch.stack(cls_t), torch.stack(box_t), torch.stack(fg)
        # the aux head predicts one class vector per P3 location: reuse the first anchor there
        aux_t = cls_t[:, : self.p3_locations * self.cfg.num_anchors : self.cfg.num_anchors]
        return {"cls": cls_t, "box": box_t, "fg": fg, "aux": aux_t, "num_pos": max(fg.sum().item(), 1.0)}

    def compute_losses(self, outputs, targets) -> Dict[str, torch.Tensor]:
        fg, num_pos = targets["fg"], targets["num_pos"]
        loss_cls = sigmoid_focal_loss(outputs["cls"], targets["cls"]).sum() / num_pos
        pred_boxes = self.decode(outputs["box"])[fg]
        loss_box, iou = giou_loss(pred_boxes, targets["box"][fg])
        iou_target = iou.detach().clamp(min=0.0)
        loss_quality = self.quality_loss(outputs["quality"][fg].sigmoid(), iou_target) / num_pos  # expect: AMP003
        return {"loss_cls": loss_cls, "loss_box": loss_box.sum() / num_pos, "loss_quality": loss_quality}

    def decode(self, deltas):
        a = self.anchors
        wa, ha = a[:, 2] - a[:, 0], a[:, 3] - a[:, 1]
        cxa, cya = a[:, 0] + 0.5 * wa, a[:, 1] + 0.5 * ha
        dx, dy, dw, dh = deltas.unbind(-1)
        dw, dh = dw.clamp(max=math.log(1000.0 / 16)), dh.clamp(max=math.log(1000.0 / 16))
        cx, cy = dx * wa + cxa, dy * ha + cya
        w, h = torch.exp(dw) * wa, torch.exp(dh) * ha
        return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], -1)

    def _clip_grads(self):
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.cfg.clip_norm)

    def run_step(self, batch):
        start = time.perf_counter()
        images, boxes, labels = self._load(batch)
        targets = self.assign_targets(boxes, labels, images.shape[-2:])
        with autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            outputs = self.model(images)
            losses = self.compute_losses(outputs, targets)
        losses["loss_aux"] = self.cfg.aux_weight * sigmoid_focal_loss(outputs["aux_cls"], targets["aux"]).sum() / targets["num_pos"]  # expect: AMP002
        total = sum(losses.values())

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        grad_norm = self._clip_grads()  # expect: AMP005
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.scheduler.step()
        self.ema.update(self.model)

        metrics = {k: v.detach().item() for k, v in losses.items()}
        metrics.update(total=total.item(), grad_norm=float(grad_norm), time=time.perf_counter() - start)
        return metrics

    @torch.no_grad()
    def evaluate(self, val_loader, score_thresh=0.05):
        model = self.ema.module
        model.eval()
        detections = []
        for batch in val_loader:
            images = batch["images"].to(self.device, non_blocking=True)
            with autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                out = model(images)
            scores = out["cls"].float().sigmoid()
            scores = scores.masked_fill(scores < score_thresh, 0.0)
            boxes = self.decode(out["box"].float())
            detections.append((boxes.cpu(), scores.cpu()))
        return detections

    def save_checkpoint(self, path):
        torch.save(
            {
                "model": self.model.state_dict(),
                "ema": copy.deepcopy(self.ema.module).half().state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "iter": self.iter,
            },
            path,
        )

    def train(self):
        best_ap = -1e9
        self.model.train()
        data_iter = iter(self.loader)
        while self.iter < self.cfg.max_iter:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(self.loader)
                batch = next(data_iter)
            metrics = self.run_step(batch)
            self.iter += 1
            if self.iter % self.cfg.log_period == 0:
                logger.info("iter %d  %s", self.iter, "  ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if self.iter % 5000 == 0:
                self.save_checkpoint(f"{self.cfg.out_dir}/model_{self.iter:07d}.pth")
        return best_ap
