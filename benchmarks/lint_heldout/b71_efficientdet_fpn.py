"""EfficientDet-style one-stage detector.

timm EfficientNet backbone -> lateral 1x1 convs + P6/P7 -> repeated BiFPN layers
with fast normalised fusion -> shared class / box heads (separable convs,
per-level BatchNorm) trained with focal loss + Huber box loss, plus a small
image-level multi-label head used as auxiliary supervision.
"""
import argparse
import logging
import math
import os
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from detection.anchors import generate_anchors, box_iou, encode_boxes, decode_boxes
from detection.backbones import create_backbone
from detection.data import build_coco_loader
from detection.eval import CocoEvaluator, batched_nms

log = logging.getLogger(__name__)

INF = 1e8

EFFDET_CFGS = {
    "d0": {"backbone": "efficientnet_b0", "fpn_ch": 64, "fpn_repeats": 3, "head_depth": 3, "img_size": 512, "se_in_fpn": False},
    "d1": {"backbone": "efficientnet_b1", "fpn_ch": 88, "fpn_repeats": 4, "head_depth": 3, "img_size": 640, "se_in_fpn": True},
    "d2": {"backbone": "efficientnet_b2", "fpn_ch": 112, "fpn_repeats": 5, "head_depth": 3, "img_size": 768, "se_in_fpn": True},
}


class DetOutput(NamedTuple):
    cls_logits: torch.Tensor  # (B, A, C)
    box_regs: torch.Tensor  # (B, A, 4)
    img_logits: torch.Tensor  # (B, C)


class SeparableConv(nn.Module):
    def __init__(self, in_ch, out_ch, bias=True):
        super().__init__()
        self.dw = nn.Conv2d(in_ch, in_ch, 3, padding=1, groups=in_ch, bias=False)
        self.pw = nn.Conv2d(in_ch, out_ch, 1, bias=bias)

    def forward(self, x):
        return self.pw(self.dw(x))


class SqueezeExcite(nn.Module):
    def __init__(self, ch, rd_ratio=0.25):
        super().__init__()
        rd = max(8, int(ch * rd_ratio))
        self.reduce = nn.Conv2d(ch, rd, 1)
        self.expand = nn.Conv2d(rd, ch, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.expand(F.silu(self.reduce(s)))
        return x * s.sigmoid()


class FusionNode(nn.Module):
    """Fast normalised fusion: sum_i relu(w_i) * x_i / (sum_j relu(w_j) + eps)."""

    def __init__(self, ch, num_inputs, use_se=False, eps=1e-4):
        super().__init__()
        self.w = nn.Parameter(torch.ones(num_inputs, dtype=torch.float32))
        self.eps = eps
        self.conv = SeparableConv(ch, ch)
        self.se = SqueezeExcite(ch) if use_se else nn.Identity()
        self.bn = nn.BatchNorm2d(ch, momentum=0.01, eps=1e-3)

    def forward(self, inputs):
        w = F.relu(self.w)
        w = w / (w.sum() + self.eps)
        fused = sum(w[i] * x for i, x in enumerate(inputs))
        out = self.conv(F.silu(fused))
        return self.bn(self.se(out))


class BiFPNLayer(nn.Module):
    def __init__(self, ch, num_levels=5, use_se=False):
        super().__init__()
        self.num_levels = num_levels
        self.td_nodes = nn.ModuleList([FusionNode(ch, 2, use_se) for _ in range(num_levels - 1)])
        self.bu_nodes = nn.ModuleList(
            [FusionNode(ch, 3 if i < num_levels - 2 else 2, use_se) for i in range(num_levels - 1)]
        )

    def forward(self, feats):
        td = list(feats)
        for i in range(self.num_levels - 2, -1, -1):
            up = F.interpolate(td[i + 1], size=feats[i].shape[-2:], mode="nearest")
            td[i] = self.td_nodes[i]([feats[i], up])
        outs = [td[0]]
        for i in range(1, self.num_levels):
            down = F.max_pool2d(outs[-1], kernel_size=3, stride=2, padding=1)
            if i < self.num_levels - 1:
                outs.append(self.bu_nodes[i - 1]([feats[i], td[i], down]))
            else:
                outs.append(self.bu_nodes[i - 1]([feats[i], down]))
        return outs


class HeadBase(nn.Module):
    """Conv tower shared across levels; BatchNorm is per level."""

    def __init__(self, ch, out_per_anchor, num_anchors=9, depth=3, num_levels=5):
        super().__init__()
        self.out_per_anchor = out_per_anchor
        self.convs = nn.ModuleList([SeparableConv(ch, ch, bias=False) for _ in range(depth)])
        self.bns = nn.ModuleList(
            [nn.ModuleList([nn.BatchNorm2d(ch, momentum=0.01, eps=1e-3) for _ in range(depth)]) for _ in range(num_levels)]
        )
        self.pred = SeparableConv(ch, num_anchors * out_per_anchor)

    def forward(self, feats):
        outs = []
        for lvl, f in enumerate(feats):
            h = f
            for conv, bn in zip(self.convs, self.bns[lvl]):
                h = F.silu(bn(conv(h)))
            p = self.pred(h)
            outs.append(p.permute(0, 2, 3, 1).reshape(p.shape[0], -1, self.out_per_anchor))
        return torch.cat(outs, dim=1)


class ClassHead(HeadBase):
    def __init__(self, ch, num_classes, prior=0.01, **kw):
        super().__init__(ch, num_classes, **kw)
        nn.init.constant_(self.pred.pw.bias, -math.log((1 - prior) / prior))


class BoxHead(HeadBase):
    def __init__(self, ch, **kw):
        super().__init__(ch, 4, **kw)


class EfficientDet(nn.Module):
    def __init__(self, cfg, num_classes=90):
        super().__init__()
        self.backbone = create_backbone(cfg["backbone"], out_indices=(2, 3, 4), pretrained=True)
        in_chs = self.backbone.feature_info.channels()
        ch = cfg["fpn_ch"]
        self.lateral = nn.ModuleList([nn.Conv2d(c, ch, 1) for c in in_chs])
        self.p6 = nn.Conv2d(in_chs[-1], ch, 3, stride=2, padding=1)
        self.p7 = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.bifpn = nn.ModuleList([BiFPNLayer(ch, 5, cfg["se_in_fpn"]) for _ in range(cfg["fpn_repeats"])])
        self.class_head = ClassHead(ch, num_classes, depth=cfg["head_depth"])
        self.box_head = BoxHead(ch, depth=cfg["head_depth"])
        self.img_head = nn.Linear(ch, num_classes)

    def forward(self, images):
        c3, c4, c5 = self.backbone(images)
        feats = [lat(f) for lat, f in zip(self.lateral, (c3, c4, c5))]
        p6 = self.p6(c5)
        p7 = self.p7(F.relu(p6))
        feats = feats + [p6, p7]
        for layer in self.bifpn:
            feats = layer(feats)
        img_logits = self.img_head(p7.mean(dim=(2, 3)))  # expect: AMP004
        return DetOutput(self.class_head(feats), self.box_head(feats), img_logits)


def build_detector(name, num_classes=90):
    return EfficientDet(EFFDET_CFGS[name], num_classes=num_classes)


class AnchorMatcher:
    def __init__(self, anchors, pos_thr=0.5, neg_thr=0.4):
        self.anchors = anchors.float()
        self.pos_thr, self.neg_thr = pos_thr, neg_thr

    @torch.no_grad()
    def __call__(self, gt_boxes, gt_labels, num_classes):
        cls_t, box_t, valid, pos = [], [], [], []
        for boxes, labels in zip(gt_boxes, gt_labels):
            A = self.anchors.shape[0]
            cls = torch.zeros(A, num_classes, device=self.anchors.device)
            if boxes.numel() == 0:
                cls_t.append(cls)
                box_t.append(torch.zeros(A, 4, device=cls.device))
                valid.append(torch.ones(A, device=cls.device))
                pos.append(torch.zeros(A, dtype=torch.bool, device=cls.device))
                continue
            iou = box_iou(self.anchors, boxes.float())
            iou[:, labels < 0] = -INF  # crowd / ignore boxes never match
            max_iou, idx = iou.max(dim=1)
            is_pos = max_iou >= self.pos_thr
            cls[is_pos, labels[idx[is_pos]]] = 1.0
            cls_t.append(cls)
            box_t.append(encode_boxes(boxes[idx].float(), self.anchors))
            valid.append(((max_iou < self.neg_thr) | is_pos).float())
            pos.append(is_pos)
        img_t = torch.stack([c.amax(dim=0) for c in cls_t])
        return torch.stack(cls_t), torch.stack(box_t), torch.stack(valid), torch.stack(pos), img_t


class DetectionLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=1.5, box_weight=50.0, img_weight=0.1, delta=0.1):
        super().__init__()
        self.alpha, self.gamma, self.delta = alpha, gamma, delta
        self.box_weight, self.img_weight = box_weight, img_weight

    def focal(self, cls_logits, cls_targets, valid):
        p = cls_logits.sigmoid()
        log_p = torch.log(p + 1e-12)  # expect: AMP011
        log_1mp = torch.log(1.0 - p + 1e-12)  # expect: AMP011
        ce = -(cls_targets * log_p + (1.0 - cls_targets) * log_1mp)
        p_t = cls_targets * p + (1.0 - cls_targets) * (1.0 - p)
        alpha_t = cls_targets * self.alpha + (1.0 - cls_targets) * (1.0 - self.alpha)
        loss = alpha_t * (1.0 - p_t) ** self.gamma * ce
        return (loss * valid.unsqueeze(-1)).sum()

    def forward(self, outputs, cls_targets, box_targets, valid, pos_mask, img_targets):
        num_pos = pos_mask.sum().clamp(min=1).float()
        cls_loss = self.focal(outputs.cls_logits, cls_targets, valid) / num_pos
        box_loss = F.smooth_l1_loss(outputs.box_regs[pos_mask], box_targets[pos_mask], beta=self.delta,
                                   reduction="sum") / (num_pos * 4.0)
        img_loss = F.binary_cross_entropy_with_logits(outputs.img_logits, img_targets)
        total = cls_loss + self.box_weight * box_loss + self.img_weight * img_loss
        return {"loss": total, "cls": cls_loss.detach(), "box": box_loss.detach(), "img": img_loss.detach()}


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def train_one_epoch(model, criterion, matcher, loader, optimizer, scaler, scheduler, epoch, args):
    model.train()
    for it, (images, targets) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        cls_t, box_t, valid, pos_mask, img_t = matcher(
            [b.cuda() for b in targets["boxes"]], [l.cuda() for l in targets["labels"]], args.num_classes
        )
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            outputs = model(images)
            losses = criterion(outputs, cls_t, box_t, valid, pos_mask, img_t)
        loss = losses["loss"]
        if not torch.isfinite(loss):
            log.warning("non-finite loss at epoch %d iter %d, skipping batch", epoch, it)
            optimizer.zero_grad(set_to_none=True)
            continue

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
        scheduler.step()

        if it % args.print_freq == 0:
            log.info("ep %d it %d loss %.4f cls %.4f box %.5f img %.4f lr %.2e", epoch, it, loss.item(),
                     losses["cls"].item(), losses["box"].item(), losses["img"].item(),
                     optimizer.param_groups[0]["lr"])


@torch.no_grad()
def evaluate(model, loader, anchors, evaluator, args):
    model.eval()
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            out = model(images.cuda(non_blocking=True))
        log.debug("mean max-score %.3f", out.cls_logits.sigmoid().amax(-1).mean().item())
        scores = out.cls_logits.float().sigmoid()
        boxes = decode_boxes(anchors, out.box_regs.float())
        for b in range(images.shape[0]):
            s, cls = scores[b].max(dim=-1)
            keep = s > args.score_thr
            dets = batched_nms(boxes[b][keep], s[keep], cls[keep], iou_threshold=0.5, max_det=100)
            evaluator.update(targets["image_id"][b], dets)
    return evaluator.summarize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="d0", choices=sorted(EFFDET_CFGS))
    p.add_argument("--num-classes", type=int, default=90)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--score-thr", type=float, default=0.05)
    p.add_argument("--print-freq", type=int, default=50)
    p.add_argument("--output", default="output/effdet")
    args = p.parse_args()

    cfg = EFFDET_CFGS[args.model]
    model = build_detector(args.model, num_classes=args.num_classes).cuda()
    anchors = generate_anchors(cfg["img_size"], levels=(3, 4, 5, 6, 7)).cuda()
    matcher = AnchorMatcher(anchors)
    criterion = DetectionLoss()
    decay, no_decay = [], []
    for n, prm in model.named_parameters():
        (no_decay if prm.ndim <= 1 or n.endswith(".w") else decay).append(prm)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 4e-5}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, eps=1e-8)
    train_loader, val_loader = build_coco_loader(args.data, cfg["img_size"], args.batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(train_loader))
    scaler = make_grad_scaler(True) if args.amp else None

    best_map = -1.0
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, matcher, train_loader, optimizer, scaler, scheduler, epoch, args)
        stats = evaluate(model, val_loader, anchors, CocoEvaluator(val_loader.dataset.coco), args)
        if stats["mAP"] > best_map:
            best_map = stats["mAP"]
            torch.save({"model": model.state_dict(), "epoch": epoch, "mAP": best_map},
                       os.path.join(args.output, "best.pth"))
        log.info("epoch %d mAP %.4f (best %.4f)", epoch, stats["mAP"], best_map)


if __name__ == "__main__":
    main()
