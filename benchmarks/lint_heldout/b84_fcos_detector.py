"""Single-stage anchor-free detector (FCOS) with an SE-gated FPN, trained on COCO-format data."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models import resnet50
from torchvision.models.feature_extraction import create_feature_extractor
from torchvision.ops import batched_nms, generalized_box_iou_loss

from datasets.coco import build_coco_loader

INF = 100000000
STRIDES = (8, 16, 32, 64, 128)
SIZE_RANGES = ((-1, 64), (64, 128), (128, 256), (256, 512), (512, INF))


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=16):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class GatedFPN(nn.Module):
    def __init__(self, in_channels=(512, 1024, 2048), out_channels=256):
        super().__init__()
        self.lateral = nn.ModuleList([nn.Conv2d(c, out_channels, 1) for c in in_channels])
        self.gates = nn.ModuleList([SqueezeExcite(out_channels) for _ in in_channels])
        self.output = nn.ModuleList([nn.Conv2d(out_channels, out_channels, 3, padding=1) for _ in in_channels])
        self.p6 = nn.Conv2d(out_channels, out_channels, 3, stride=2, padding=1)
        self.p7 = nn.Conv2d(out_channels, out_channels, 3, stride=2, padding=1)

    def forward(self, feats):
        laterals = []
        for conv, gate, f in zip(self.lateral, self.gates, feats):
            laterals.append(gate(conv(f)))
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], size=laterals[i - 1].shape[-2:], mode="nearest")
        outs = [conv(l) for conv, l in zip(self.output, laterals)]
        p6 = self.p6(outs[-1])
        return outs + [p6, self.p7(F.relu(p6))]


class FCOSHead(nn.Module):
    def __init__(self, num_classes, channels=256, num_convs=4, prior=0.01):
        super().__init__()
        def tower():
            layers = []
            for _ in range(num_convs):
                layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(32, channels), nn.ReLU()]
            return nn.Sequential(*layers)
        self.cls_tower, self.reg_tower = tower(), tower()
        self.cls_logits = nn.Conv2d(channels, num_classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(channels, 4, 3, padding=1)
        self.centerness = nn.Conv2d(channels, 1, 3, padding=1)
        self.scales = nn.Parameter(torch.ones(len(STRIDES)))
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - prior) / prior))

    def forward(self, feats, pad_masks=None):
        cls_outs, reg_outs, ctr_outs = [], [], []
        for lvl, (f, stride) in enumerate(zip(feats, STRIDES)):
            t = self.cls_tower(f)
            logits = self.cls_logits(t)
            if pad_masks is not None:
                pad = F.interpolate(pad_masks[:, None].float(), size=logits.shape[-2:]) > 0.5
                logits = logits.masked_fill(pad, -1e9)  # expect: AMP007
            r = self.reg_tower(f)
            cls_outs.append(logits)
            reg_outs.append(F.relu(self.bbox_pred(r) * self.scales[lvl]) * stride)
            ctr_outs.append(self.centerness(r))
        return cls_outs, reg_outs, ctr_outs


class FCOS(nn.Module):
    def __init__(self, num_classes=80):
        super().__init__()
        body = resnet50(weights="IMAGENET1K_V2")
        self.body = create_feature_extractor(body, {"layer2": "c3", "layer3": "c4", "layer4": "c5"})
        self.fpn = GatedFPN()
        self.head = FCOSHead(num_classes)

    def forward(self, images, pad_masks=None):
        c = self.body(images)
        return self.head(self.fpn([c["c3"], c["c4"], c["c5"]]), pad_masks)


def sigmoid_focal_loss(inputs, targets, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(inputs)
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).sum()


def level_points(h, w, stride, device):
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=device),
                            torch.arange(w, dtype=torch.float32, device=device), indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], -1) * stride + stride // 2


class FCOSCriterion(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.num_classes = num_classes

    @torch.no_grad()
    def assign(self, points, ranges, boxes, labels):
        xs, ys = points[:, 0:1], points[:, 1:2]
        ltrb = torch.stack([xs - boxes[:, 0], ys - boxes[:, 1], boxes[:, 2] - xs, boxes[:, 3] - ys], -1)
        areas = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].repeat(len(points), 1)
        max_side = ltrb.max(-1).values
        inside = ltrb.min(-1).values > 0
        in_range = (max_side >= ranges[:, 0:1]) & (max_side <= ranges[:, 1:2])
        areas[~(inside & in_range)] = INF
        min_area, idx = areas.min(dim=1)
        cls_t = labels[idx].clone()
        cls_t[min_area == INF] = self.num_classes
        reg_t = ltrb[torch.arange(len(points)), idx]
        lr, tb = reg_t[:, 0::2], reg_t[:, 1::2]
        ctr_t = torch.sqrt((lr.min(-1).values / lr.max(-1).values.clamp(min=1e-6))
                           * (tb.min(-1).values / tb.max(-1).values.clamp(min=1e-6)))
        return cls_t, reg_t, ctr_t

    def forward(self, outputs, targets):
        cls_outs, reg_outs, ctr_outs = outputs
        N, C = cls_outs[0].shape[:2]
        device = cls_outs[0].device
        points = torch.cat([level_points(*o.shape[-2:], s, device) for o, s in zip(cls_outs, STRIDES)])
        ranges = torch.cat([torch.tensor([r], dtype=torch.float32, device=device).expand(o.shape[-2] * o.shape[-1], 2)
                            for o, r in zip(cls_outs, SIZE_RANGES)])
        cls_p = torch.cat([o.permute(0, 2, 3, 1).reshape(N, -1, C) for o in cls_outs], 1)
        reg_p = torch.cat([o.permute(0, 2, 3, 1).reshape(N, -1, 4) for o in reg_outs], 1)
        ctr_p = torch.cat([o.permute(0, 2, 3, 1).reshape(N, -1) for o in ctr_outs], 1)
        assigned = [self.assign(points, ranges, t["boxes"], t["labels"]) for t in targets]
        cls_t = torch.stack([a[0] for a in assigned])
        reg_t = torch.stack([a[1] for a in assigned])
        ctr_t = torch.stack([a[2] for a in assigned])

        pos = cls_t < self.num_classes
        num_pos = max(pos.sum().item(), 1.0)
        onehot = F.one_hot(cls_t, self.num_classes + 1)[..., :-1].float()
        loss_cls = sigmoid_focal_loss(cls_p, onehot) / num_pos
        pts = points[None].expand(N, -1, -1)[pos]
        to_box = lambda p, d: torch.cat([p - d[:, :2], p + d[:, 2:]], -1)
        giou = generalized_box_iou_loss(to_box(pts, reg_p[pos].float()), to_box(pts, reg_t[pos]), reduction="none", eps=1e-7)
        loss_reg = (giou * ctr_t[pos]).sum() / ctr_t[pos].sum().clamp(min=1e-6)
        loss_ctr = F.binary_cross_entropy(ctr_p[pos].sigmoid(), ctr_t[pos], reduction="sum") / num_pos  # expect: AMP003
        return {"loss_cls": loss_cls, "loss_reg": loss_reg, "loss_ctr": loss_ctr}


@torch.inference_mode()
def predict(model, images, score_thresh=0.05, nms_thresh=0.6, max_det=100):
    model.eval()
    cls_outs, reg_outs, ctr_outs = model(images)
    results = []
    for b in range(images.shape[0]):
        boxes_all, scores_all, labels_all = [], [], []
        for o_cls, o_reg, o_ctr, s in zip(cls_outs, reg_outs, ctr_outs, STRIDES):
            pts = level_points(*o_cls.shape[-2:], s, images.device)
            scores = torch.sqrt(o_cls[b].sigmoid().flatten(1).t() * o_ctr[b].sigmoid().flatten(1).t())
            pi, ci = (scores > score_thresh).nonzero(as_tuple=True)
            d = o_reg[b].flatten(1).t()[pi].float()
            boxes_all.append(torch.cat([pts[pi] - d[:, :2], pts[pi] + d[:, 2:]], -1))
            scores_all.append(scores[pi, ci].float())
            labels_all.append(ci)
        boxes, scores, labels = map(torch.cat, (boxes_all, scores_all, labels_all))
        keep = batched_nms(boxes, scores, labels, nms_thresh)[:max_det]
        results.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]})
    return results


def train(cfg):
    device = torch.device("cuda")
    loader = build_coco_loader(cfg.data_root, "train2017", batch_size=cfg.batch_size, with_pad_mask=True)
    model = FCOS(cfg.num_classes).to(device)
    criterion = FCOSCriterion(cfg.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    for epoch in range(cfg.epochs):
        model.train()
        for it, (images, pad_masks, targets) in enumerate(loader):
            images, pad_masks = images.to(device), pad_masks.to(device)
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", dtype=torch.float16):
                outputs = model(images, pad_masks)
                losses = criterion(outputs, targets)
                loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            scaler.step(optimizer)
            scaler.update()
            if it % 20 == 0:
                print(epoch, it, {k: round(v.item(), 4) for k, v in losses.items()})
        torch.save(model.state_dict(), f"{cfg.out}/fcos_e{epoch}.pth")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/coco")
    ap.add_argument("--num-classes", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--clip", type=float, default=35.0)
    ap.add_argument("--out", default="work_dirs/fcos")
    train(ap.parse_args())
