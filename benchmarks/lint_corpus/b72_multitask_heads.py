"""Driving perception: FCOS-style detection + drivable-area and lane segmentation heads.

Every head comes with its own loss module; ``MultiTaskCriterion`` combines them.
"""
import argparse
import copy
import logging
import math
import os
import time

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.ops import sigmoid_focal_loss

from perception.backbones import build_backbone
from perception.data import BDDMultiTask, collate_multitask
from perception.utils import AverageMeter, fast_hist, per_class_iou, save_checkpoint

logger = logging.getLogger(__name__)

INF = 1e8
IGNORE_INDEX = 255
SIZES_OF_INTEREST = ((-1, 64), (64, 128), (128, 256), (256, 512), (512, INF))
FPN_STRIDES = (8, 16, 32, 64, 128)


def conv_gn_relu(in_ch, out_ch, groups=32):
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
        nn.GroupNorm(groups, out_ch),
        nn.ReLU(inplace=True),
    )


def compute_locations(features, strides):
    locations = []
    for feature, stride in zip(features, strides):
        h, w = feature.shape[-2:]
        shifts_x = torch.arange(0, w * stride, step=stride, dtype=torch.float32, device=feature.device)
        shifts_y = torch.arange(0, h * stride, step=stride, dtype=torch.float32, device=feature.device)
        shift_y, shift_x = torch.meshgrid(shifts_y, shifts_x, indexing="ij")
        locations.append(torch.stack((shift_x.reshape(-1), shift_y.reshape(-1)), dim=1) + stride // 2)
    return locations


class Scale(nn.Module):
    def __init__(self, init_value=1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(init_value, dtype=torch.float32))

    def forward(self, x):
        return x * self.scale


class FCOSHead(nn.Module):
    def __init__(self, in_channels, num_classes, num_convs=4, prior_prob=0.01, strides=FPN_STRIDES):
        super().__init__()
        self.strides = strides
        self.cls_tower = nn.Sequential(*[conv_gn_relu(in_channels, in_channels) for _ in range(num_convs)])
        self.bbox_tower = nn.Sequential(*[conv_gn_relu(in_channels, in_channels) for _ in range(num_convs)])
        self.cls_logits = nn.Conv2d(in_channels, num_classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.centerness = nn.Conv2d(in_channels, 1, 3, padding=1)
        self.scales = nn.ModuleList([Scale(1.0) for _ in strides])
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - prior_prob) / prior_prob))

    def forward(self, features):
        logits, bbox_reg, centerness = [], [], []
        for level, feature in enumerate(features):
            cls_feat = self.cls_tower(feature)
            box_feat = self.bbox_tower(feature)
            logits.append(self.cls_logits(cls_feat))
            centerness.append(self.centerness(box_feat))
            bbox_reg.append(torch.exp(self.scales[level](self.bbox_pred(box_feat))))
        return logits, bbox_reg, centerness


class SegHead(nn.Module):
    """Drivable area (3 classes) and lane lines (binary) from the two finest FPN levels."""

    def __init__(self, in_channels, num_classes=3, mid_channels=128):
        super().__init__()
        self.fuse = conv_gn_relu(in_channels, mid_channels)
        self.drivable = nn.Conv2d(mid_channels, num_classes, 1)
        self.drivable_aux = nn.Conv2d(in_channels, num_classes, 1)
        self.lane = nn.Conv2d(mid_channels, 1, 1)

    def forward(self, p3, p4, image_size):
        x = self.fuse(p3 + F.interpolate(p4, size=p3.shape[-2:], mode="bilinear", align_corners=False))
        drivable = F.interpolate(self.drivable(x), size=image_size, mode="bilinear", align_corners=False)
        aux = F.interpolate(self.drivable_aux(p4), size=image_size, mode="bilinear", align_corners=False)
        lane = F.interpolate(self.lane(x), size=image_size, mode="bilinear", align_corners=False)
        return drivable, aux, lane


class PerceptionNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.backbone = build_backbone(cfg.backbone, out_channels=cfg.fpn_channels, pretrained=cfg.pretrained)
        self.det_head = FCOSHead(cfg.fpn_channels, cfg.num_classes)
        self.seg_head = SegHead(cfg.fpn_channels, cfg.num_drivable_classes)

    def forward(self, images):
        feats = self.backbone(images)
        cls_logits, bbox_reg, centerness = self.det_head(feats)
        drivable, drivable_aux, lane = self.seg_head(feats[0], feats[1], images.shape[-2:])
        return {
            "cls_logits": cls_logits,
            "bbox_reg": bbox_reg,
            "centerness": centerness,
            "locations": compute_locations(feats, self.det_head.strides),
            "drivable": drivable,
            "drivable_aux": drivable_aux,
            "lane": lane,
        }


# ----------------------------------------------------------------------------- losses


class IOULoss(nn.Module):
    def forward(self, pred, target, weight=None):
        pred_left, pred_top, pred_right, pred_bottom = pred.float().unbind(1)
        target_left, target_top, target_right, target_bottom = target.unbind(1)
        target_area = (target_left + target_right) * (target_top + target_bottom)
        pred_area = (pred_left + pred_right) * (pred_top + pred_bottom)
        w_intersect = torch.min(pred_left, target_left) + torch.min(pred_right, target_right)
        h_intersect = torch.min(pred_bottom, target_bottom) + torch.min(pred_top, target_top)
        area_intersect = w_intersect * h_intersect
        area_union = target_area + pred_area - area_intersect
        losses = -torch.log((area_intersect + 1.0) / (area_union + 1.0))
        if weight is not None:
            return (losses * weight).sum()
        return losses.sum()


class FCOSLoss(nn.Module):
    def __init__(self, num_classes, strides, focal_alpha=0.25, focal_gamma=2.0):
        super().__init__()
        self.num_classes = num_classes
        self.strides = strides
        self.focal_alpha = focal_alpha
        self.focal_gamma = focal_gamma
        self.box_loss = IOULoss()
        self.centerness_loss = nn.BCELoss(reduction="sum")

    @torch.no_grad()
    def prepare_targets(self, locations, targets):
        expanded = [loc.new_tensor(SIZES_OF_INTEREST[l]).expand(len(loc), -1) for l, loc in enumerate(locations)]
        num_per_level = [len(loc) for loc in locations]
        expanded = torch.cat(expanded, dim=0)
        points = torch.cat(locations, dim=0)
        xs, ys = points[:, 0], points[:, 1]
        labels, reg_targets = [], []
        for target in targets:
            boxes, classes = target["boxes"], target["labels"]
            area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
            l = xs[:, None] - boxes[:, 0][None]
            t = ys[:, None] - boxes[:, 1][None]
            r = boxes[:, 2][None] - xs[:, None]
            b = boxes[:, 3][None] - ys[:, None]
            reg = torch.stack([l, t, r, b], dim=2)
            is_in_boxes = reg.min(dim=2)[0] > 0
            max_reg = reg.max(dim=2)[0]
            is_cared = (max_reg >= expanded[:, [0]]) & (max_reg <= expanded[:, [1]])
            areas = area[None].repeat(len(points), 1)
            areas[~is_in_boxes] = INF
            areas[~is_cared] = INF
            min_area, gt_inds = areas.min(dim=1)
            reg = reg[range(len(points)), gt_inds]
            cls = classes[gt_inds]
            cls[min_area == INF] = self.num_classes
            labels.append(torch.split(cls, num_per_level))
            reg_targets.append(torch.split(reg, num_per_level))
        labels = [torch.cat([lab[l] for lab in labels]) for l in range(len(locations))]
        reg_targets = [torch.cat([reg[l] for reg in reg_targets]) / self.strides[l] for l in range(len(locations))]
        return torch.cat(labels), torch.cat(reg_targets)

    @staticmethod
    def centerness_targets(reg_targets):
        left_right = reg_targets[:, [0, 2]]
        top_bottom = reg_targets[:, [1, 3]]
        ratio = (left_right.min(dim=-1)[0] / left_right.max(dim=-1)[0]) * (
            top_bottom.min(dim=-1)[0] / top_bottom.max(dim=-1)[0]
        )
        return torch.sqrt(ratio)

    def forward(self, cls_logits, bbox_reg, centerness, locations, targets):
        labels, reg_targets = self.prepare_targets(locations, targets)
        cls_flat = torch.cat([x.permute(0, 2, 3, 1).reshape(-1, self.num_classes) for x in cls_logits])
        box_flat = torch.cat([x.permute(0, 2, 3, 1).reshape(-1, 4) for x in bbox_reg])
        ctr_flat = torch.cat([x.permute(0, 2, 3, 1).reshape(-1) for x in centerness])

        pos_inds = torch.nonzero(labels != self.num_classes).squeeze(1)
        num_pos = max(pos_inds.numel(), 1.0)
        one_hot = F.one_hot(labels, self.num_classes + 1)[:, :-1].float()
        cls_loss = sigmoid_focal_loss(
            cls_flat, one_hot, alpha=self.focal_alpha, gamma=self.focal_gamma, reduction="sum"
        ) / num_pos

        box_flat, reg_targets, ctr_flat = box_flat[pos_inds], reg_targets[pos_inds], ctr_flat[pos_inds]
        if pos_inds.numel() > 0:
            ctr_targets = self.centerness_targets(reg_targets)
            reg_loss = self.box_loss(box_flat, reg_targets, ctr_targets) / ctr_targets.sum()
            ctr_loss = self.centerness_loss(ctr_flat.sigmoid(), ctr_targets) / num_pos  # expect: AMP003
        else:
            reg_loss = box_flat.sum() * 0.0
            ctr_loss = ctr_flat.sum() * 0.0
        return {"loss_cls": cls_loss, "loss_reg": reg_loss, "loss_ctr": ctr_loss}


class OhemCrossEntropy(nn.Module):
    def __init__(self, ignore_index=IGNORE_INDEX, thresh=0.7, min_kept=100_000):
        super().__init__()
        self.ignore_index = ignore_index
        self.thresh = -math.log(thresh)
        self.min_kept = min_kept

    def forward(self, logits, target):
        pixel_losses = F.cross_entropy(logits.float(), target, ignore_index=self.ignore_index, reduction="none")
        pixel_losses = pixel_losses.flatten()[target.flatten() != self.ignore_index]
        if pixel_losses.numel() == 0:
            return logits.sum() * 0.0
        n_min = min(self.min_kept, pixel_losses.numel() - 1)
        threshold = max(pixel_losses.topk(n_min + 1).values[-1].item(), self.thresh)
        return pixel_losses[pixel_losses >= threshold].mean()


def soft_dice_loss(probs, target, smooth=1.0):
    probs = probs.flatten(1)
    target = target.flatten(1)
    inter = (probs * target).sum(1)
    union = probs.sum(1) + target.sum(1)
    return 1.0 - ((2.0 * inter + smooth) / (union + smooth)).mean()


class DiceBCELoss(nn.Module):
    def __init__(self, bce_weight=1.0, dice_weight=1.0, smooth=1.0):
        super().__init__()
        self.bce = nn.BCELoss()
        self.bce_weight = bce_weight
        self.dice_weight = dice_weight
        self.smooth = smooth

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        bce = self.bce(probs, target)  # expect: AMP003
        dice = soft_dice_loss(probs.float(), target, self.smooth)
        return self.bce_weight * bce + self.dice_weight * dice


class MultiTaskCriterion(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.det = FCOSLoss(cfg.num_classes, FPN_STRIDES)
        self.drivable = OhemCrossEntropy(thresh=cfg.ohem_thresh)
        self.lane = DiceBCELoss(bce_weight=cfg.lane_bce_weight)
        self.weights = {"loss_drivable": cfg.drivable_weight, "loss_lane": cfg.lane_weight}

    def forward(self, outputs, targets):
        losses = self.det(
            outputs["cls_logits"], outputs["bbox_reg"], outputs["centerness"], outputs["locations"], targets["det"]
        )
        losses["loss_drivable"] = self.drivable(outputs["drivable"], targets["drivable"])
        losses["loss_lane"] = self.lane(outputs["lane"], targets["lane"])
        return {k: self.weights.get(k, 1.0) * v for k, v in losses.items()}



# ----------------------------------------------------------------------------- train / eval


def to_device(targets, device):
    out = {"det": [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets["det"]]}
    out["drivable"] = targets["drivable"].to(device, non_blocking=True)
    out["lane"] = targets["lane"].to(device, non_blocking=True).float()
    return out


def train_one_epoch(model, criterion, loader, optimizer, scheduler, scaler, epoch, cfg):
    model.train()
    loss_meter = AverageMeter()
    start = time.time()
    for it, (images, targets) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        targets = to_device(targets, images.device)

        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
            loss_dict = criterion(outputs, targets)
        aux_loss = F.cross_entropy(outputs["drivable_aux"], targets["drivable"], ignore_index=IGNORE_INDEX)  # expect: AMP002
        loss = sum(loss_dict.values()) + cfg.aux_weight * aux_loss

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        loss_meter.update(loss.item(), images.size(0))
        if it % cfg.log_interval == 0:
            logger.info("epoch %d it %d loss %.4f scale %.0f %.1fs", epoch, it, loss_meter.avg,
                        scaler.get_scale(), time.time() - start)
    return loss_meter.avg


@torch.no_grad()
def evaluate(model, criterion, loader, cfg):
    model.eval()
    n = cfg.num_drivable_classes
    hist = torch.zeros(n, n, dtype=torch.int64, device="cuda")
    lane_tp = lane_fp = lane_fn = 0
    val_loss = AverageMeter()
    for images, targets in loader:
        images = images.cuda(non_blocking=True)
        targets = to_device(targets, images.device)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
        loss_dict = criterion(outputs, targets)  # expect: AMP002
        val_loss.update(sum(v.item() for v in loss_dict.values()), images.size(0))

        pred = outputs["drivable"].argmax(1)
        hist += fast_hist(pred.flatten(), targets["drivable"].flatten(), n)
        lane_pred = outputs["lane"][:, 0].sigmoid() > 0.5
        lane_gt = targets["lane"] > 0.5
        lane_tp += (lane_pred & lane_gt).sum().item()
        lane_fp += (lane_pred & ~lane_gt).sum().item()
        lane_fn += (~lane_pred & lane_gt).sum().item()
    miou = per_class_iou(hist.cpu().numpy()).mean()
    return {"val_loss": val_loss.avg, "drivable_miou": float(miou),
            "lane_iou": lane_tp / max(lane_tp + lane_fp + lane_fn, 1)}


def make_grad_scaler(enabled=True):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


@torch.no_grad()
def export_half_checkpoint(model, path):
    serving = copy.deepcopy(model).half().eval()
    torch.save({"model": serving.state_dict()}, path)


def parse_args():
    p = argparse.ArgumentParser("multi-task perception")
    p.add_argument("--data-root", required=True)
    p.add_argument("--epochs", type=int, default=36)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--clip-grad", type=float, default=10.0)
    p.add_argument("--aux-weight", type=float, default=0.4)
    p.add_argument("--output", default="runs/multitask")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = argparse.Namespace(
        backbone="resnet50", fpn_channels=256, pretrained=True, num_classes=10, num_drivable_classes=3,
        ohem_thresh=0.7, lane_bce_weight=1.0, drivable_weight=1.0, lane_weight=2.0,
        aux_weight=args.aux_weight, clip_grad=args.clip_grad, log_interval=50,
    )
    train_set = BDDMultiTask(args.data_root, split="train")
    val_set = BDDMultiTask(args.data_root, split="val")
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              collate_fn=collate_multitask, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=8, collate_fn=collate_multitask)

    model = PerceptionNet(cfg).cuda()
    criterion = MultiTaskCriterion(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * len(train_loader))
    scaler = make_grad_scaler()

    os.makedirs(args.output, exist_ok=True)
    best_miou = 0.0
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, criterion, train_loader, optimizer, scheduler, scaler, epoch, cfg)
        metrics = evaluate(model, criterion, val_loader, cfg)
        logger.info("epoch %d train_loss %.4f %s", epoch, train_loss, metrics)
        if metrics["drivable_miou"] > best_miou:
            best_miou = metrics["drivable_miou"]
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "epoch": epoch},
                            os.path.join(args.output, "best.pth"))
    export_half_checkpoint(model, os.path.join(args.output, "serving_fp16.pth"))


if __name__ == "__main__":
    main()
