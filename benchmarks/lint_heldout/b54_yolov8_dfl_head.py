"""YOLOv8-style anchor-free detector with a task-aligned decoupled head.

Box branch predicts a discrete distribution per side (DFL, reg_max bins); the class score
is the TOOD geometric mean of a class logit and a task-alignment logit, modulated by a
GFLv2 distribution-guided quality predictor.  Loss: QFL on the aligned scores, CIoU and
DFL, targets from a task-aligned assigner.  Ultralytics-like trainer with fp16 AMP.
"""
import argparse
import math
from copy import deepcopy

import torch
import torch.nn as nn
import torch.nn.functional as F


class Conv(nn.Module):
    def __init__(self, c1, c2, k=1, s=1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=0.001, momentum=0.03)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class EffectiveSE(nn.Module):
    """timm's eSE: one FC on the globally pooled map, hard gate."""

    def __init__(self, channels):
        super().__init__()
        self.fc = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        x_se = x.mean((2, 3), keepdim=True)  # expect: AMP004
        return x * F.hardsigmoid(self.fc(x_se))


class DFL(nn.Module):
    def __init__(self, c1=16):
        super().__init__()
        self.conv = nn.Conv2d(c1, 1, 1, bias=False).requires_grad_(False)
        self.conv.weight.data[:] = torch.arange(c1, dtype=torch.float).view(1, c1, 1, 1)
        self.c1 = c1

    def forward(self, x):
        b, _, a = x.shape
        return self.conv(x.view(b, 4, self.c1, a).transpose(2, 1).softmax(1)).view(b, 4, a)


def make_anchors(feats, strides, grid_cell_offset=0.5):
    anchor_points, stride_tensor = [], []
    dtype, device = feats[0].dtype, feats[0].device
    for i, stride in enumerate(strides):
        _, _, h, w = feats[i].shape
        sx = torch.arange(end=w, device=device, dtype=dtype) + grid_cell_offset
        sy = torch.arange(end=h, device=device, dtype=dtype) + grid_cell_offset
        sy, sx = torch.meshgrid(sy, sx, indexing="ij")
        anchor_points.append(torch.stack((sx, sy), -1).view(-1, 2))
        stride_tensor.append(torch.full((h * w, 1), float(stride), dtype=dtype, device=device))
    return torch.cat(anchor_points), torch.cat(stride_tensor)


def dist2bbox(distance, anchor_points, xywh=True, dim=-1):
    lt, rb = distance.chunk(2, dim)
    x1y1, x2y2 = anchor_points - lt, anchor_points + rb
    if xywh:
        return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), dim)
    return torch.cat((x1y1, x2y2), dim)


def bbox2dist(anchor_points, bbox, reg_max):
    x1y1, x2y2 = bbox.chunk(2, -1)
    return torch.cat((anchor_points - x1y1, x2y2 - anchor_points), -1).clamp_(0, reg_max - 0.01)


def bbox_iou(box1, box2, eps=1e-7):
    """CIoU of boxes in xyxy format."""
    (b1_x1, b1_y1, b1_x2, b1_y2), (b2_x1, b2_y1, b2_x2, b2_y2) = box1.chunk(4, -1), box2.chunk(4, -1)
    w1, h1 = b1_x2 - b1_x1, b1_y2 - b1_y1 + eps
    w2, h2 = b2_x2 - b2_x1, b2_y2 - b2_y1 + eps
    inter = (b1_x2.minimum(b2_x2) - b1_x1.maximum(b2_x1)).clamp_(0) * (b1_y2.minimum(b2_y2) - b1_y1.maximum(b2_y1)).clamp_(0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    cw = b1_x2.maximum(b2_x2) - b1_x1.minimum(b2_x1)
    ch = b1_y2.maximum(b2_y2) - b1_y1.minimum(b2_y1)
    c2 = cw.pow(2) + ch.pow(2) + eps
    rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2).pow(2) + (b2_y1 + b2_y2 - b1_y1 - b1_y2).pow(2)) / 4
    v = (4 / math.pi ** 2) * ((w2 / h2).atan() - (w1 / h1).atan()).pow(2)
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


class AlignedDetect(nn.Module):
    def __init__(self, nc=80, ch=(), reg_max=16, dgqp_channels=64):
        super().__init__()
        self.nc, self.nl, self.reg_max = nc, len(ch), reg_max
        self.no = nc + reg_max * 4
        self.stride = torch.tensor([8.0, 16.0, 32.0])
        c2, c3 = max(16, ch[0] // 4, reg_max * 4), max(ch[0], min(nc, 100))
        self.stems = nn.ModuleList(nn.Sequential(nn.Conv2d(x, x, 1), EffectiveSE(x)) for x in ch)
        self.cv2 = nn.ModuleList(nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for x in ch)
        self.cv3 = nn.ModuleList(nn.Sequential(Conv(x, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for x in ch)
        self.cls_prob = nn.ModuleList(nn.Sequential(Conv(x, c3, 3), nn.Conv2d(c3, 1, 1)) for x in ch)
        self.reg_conf = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4 * 5, dgqp_channels, 1), nn.ReLU(inplace=True), nn.Conv2d(dgqp_channels, 1, 1), nn.Sigmoid())
            for _ in ch)
        self.dfl = DFL(reg_max)

    def forward(self, x):
        outs = []
        for i in range(self.nl):
            feat = self.stems[i](x[i])
            box = self.cv2[i](feat)
            b, _, h, w = box.shape
            prob = F.softmax(box.view(b, 4, self.reg_max, h, w), dim=2)
            prob_topk, _ = prob.topk(4, dim=2)
            stat = torch.cat([prob_topk, prob_topk.mean(dim=2, keepdim=True)], dim=2)
            quality = self.reg_conf[i](stat.reshape(b, -1, h, w))
            cls_score = torch.sqrt(torch.sigmoid(self.cv3[i](feat)) * torch.sigmoid(self.cls_prob[i](feat)) + 1e-12)  # expect: AMP011
            outs.append(torch.cat((box, cls_score * quality), 1))
        return outs if self.training else self.decode(outs)

    def decode(self, outs):
        anchors, strides = (t.transpose(0, 1) for t in make_anchors(outs, self.stride, 0.5))
        x_cat = torch.cat([o.view(outs[0].shape[0], self.no, -1) for o in outs], 2)
        box, cls = x_cat.split((self.reg_max * 4, self.nc), 1)
        dbox = dist2bbox(self.dfl(box), anchors.unsqueeze(0), xywh=True, dim=1) * strides
        return torch.cat((dbox, cls), 1)


class YOLODetector(nn.Module):
    def __init__(self, cfg, width=16):
        super().__init__()
        w = width
        self.stem = nn.Sequential(Conv(3, w, 3, 2), Conv(w, 2 * w, 3, 2), Conv(2 * w, 2 * w, 3))
        self.stages = nn.ModuleList([
            nn.Sequential(Conv(2 * w, 4 * w, 3, 2), Conv(4 * w, 4 * w, 3)),
            nn.Sequential(Conv(4 * w, 8 * w, 3, 2), Conv(8 * w, 8 * w, 3)),
            nn.Sequential(Conv(8 * w, 16 * w, 3, 2), Conv(16 * w, 16 * w, 3)),
        ])
        self.head = AlignedDetect(cfg["nc"], ch=(4 * w, 8 * w, 16 * w), reg_max=cfg["reg_max"])

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        return self.head(feats)


MODELS = {
    "yolov8n-tal": lambda cfg: YOLODetector(cfg, width=16),
    "yolov8s-tal": lambda cfg: YOLODetector(cfg, width=32),
}


class TaskAlignedAssigner(nn.Module):
    def __init__(self, topk=10, alpha=0.5, beta=6.0):
        super().__init__()
        self.topk, self.alpha, self.beta = topk, alpha, beta

    @torch.no_grad()
    def forward(self, pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt):
        bs, n_max, na = pd_scores.shape[0], gt_bboxes.shape[1], pd_bboxes.shape[1]
        lt, rb = gt_bboxes.view(-1, 1, 4).chunk(2, 2)
        in_gts = torch.cat((anc_points[None] - lt, rb - anc_points[None]), 2).view(bs, n_max, na, -1).amin(3).gt_(1e-9)
        mask = (in_gts * mask_gt).bool()
        bbox_scores = torch.zeros([bs, n_max, na], dtype=pd_scores.dtype, device=pd_scores.device)
        overlaps = torch.zeros([bs, n_max, na], dtype=pd_bboxes.dtype, device=pd_bboxes.device)
        b_idx = torch.arange(bs, device=pd_scores.device).view(-1, 1).expand(-1, n_max)
        bbox_scores[mask] = pd_scores[b_idx, :, gt_labels.squeeze(-1).long()][mask]
        pd_boxes = pd_bboxes.unsqueeze(1).expand(-1, n_max, -1, -1)[mask]
        gt_boxes = gt_bboxes.unsqueeze(2).expand(-1, -1, na, -1)[mask]
        overlaps[mask] = bbox_iou(gt_boxes, pd_boxes).squeeze(-1).clamp_(0)
        align_metric = bbox_scores.pow(self.alpha) * overlaps.pow(self.beta)
        topk_idx = align_metric.topk(self.topk, dim=-1).indices
        mask_pos = torch.zeros_like(align_metric).scatter_(-1, topk_idx, 1.0) * mask * mask_gt
        fg_mask = mask_pos.sum(-2) > 0
        target_gt_idx = (overlaps * mask_pos).argmax(-2)
        flat_idx = target_gt_idx + b_idx[:, :1] * n_max
        target_bboxes = gt_bboxes.view(-1, 4)[flat_idx]
        target_labels = gt_labels.long().flatten()[flat_idx].clamp_(0)
        target_scores = F.one_hot(target_labels, pd_scores.shape[-1]).float() * fg_mask[..., None]
        align_metric = align_metric * mask_pos
        pos_align_metrics = align_metric.amax(dim=-1, keepdim=True)
        pos_overlaps = (overlaps * mask_pos).amax(dim=-1, keepdim=True)
        norm_align_metric = (align_metric * pos_overlaps / (pos_align_metrics + 1e-9)).amax(-2).unsqueeze(-1)
        return target_bboxes, target_scores * norm_align_metric, fg_mask


def quality_focal_loss_with_prob(pred, target, beta=2.0):
    """mmdet QFL for activated predictions: pred is already a probability."""
    scale_factor = (pred - target).abs().pow(beta)
    return F.binary_cross_entropy(pred, target, reduction="none") * scale_factor  # expect: AMP003


class DetectionLoss:
    def __init__(self, head, hyp):
        self.nc, self.reg_max, self.no, self.stride = head.nc, head.reg_max, head.no, head.stride
        self.assigner = TaskAlignedAssigner(topk=10, alpha=0.5, beta=6.0)
        self.proj = torch.arange(self.reg_max, dtype=torch.float)
        self.hyp = hyp

    def df_loss(self, pred_dist, target):
        tl = target.long()
        tr, wl = tl + 1, tl + 1 - target
        return (F.cross_entropy(pred_dist, tl.view(-1), reduction="none").view(tl.shape) * wl
                + F.cross_entropy(pred_dist, tr.view(-1), reduction="none").view(tl.shape) * (1 - wl)).mean(-1, keepdim=True)

    def __call__(self, preds, batch):
        b = preds[0].shape[0]
        pred_distri, pred_scores = torch.cat([p.view(b, self.no, -1) for p in preds], 2).split((self.reg_max * 4, self.nc), 1)
        pred_scores, pred_distri = pred_scores.permute(0, 2, 1).contiguous(), pred_distri.permute(0, 2, 1).contiguous()
        anchor_points, stride_tensor = make_anchors(preds, self.stride, 0.5)
        proj = self.proj.to(pred_distri.device).type(pred_distri.dtype)
        pred_bboxes = dist2bbox(pred_distri.view(b, -1, 4, self.reg_max).softmax(3).matmul(proj), anchor_points, xywh=False)
        gt_labels, gt_bboxes = batch["cls"].to(pred_scores.device), batch["bboxes"].to(pred_scores.device)
        mask_gt = gt_bboxes.sum(2, keepdim=True).gt_(0.0)
        target_bboxes, target_scores, fg_mask = self.assigner(
            pred_scores.detach(), (pred_bboxes.detach() * stride_tensor).type(gt_bboxes.dtype),
            anchor_points * stride_tensor, gt_labels, gt_bboxes, mask_gt)
        target_scores_sum = max(target_scores.sum(), 1)
        loss = torch.zeros(3, device=pred_scores.device)
        loss[1] = quality_focal_loss_with_prob(pred_scores, target_scores).sum() / target_scores_sum
        if fg_mask.sum():
            target_bboxes = target_bboxes / stride_tensor
            weight = target_scores.sum(-1)[fg_mask].unsqueeze(-1)
            iou = bbox_iou(pred_bboxes[fg_mask], target_bboxes[fg_mask])
            loss[0] = ((1.0 - iou) * weight).sum() / target_scores_sum
            target_ltrb = bbox2dist(anchor_points, target_bboxes, self.reg_max)
            loss[2] = (self.df_loss(pred_distri[fg_mask].view(-1, self.reg_max), target_ltrb[fg_mask]) * weight).sum() / target_scores_sum
        loss = loss * torch.tensor([self.hyp["box"], self.hyp["cls"], self.hyp["dfl"]], device=loss.device)
        return loss.sum() * b, loss.detach()


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000):
        self.ema = deepcopy(model).eval().requires_grad_(False)
        self.updates, self.decay = 0, lambda x: decay * (1 - math.exp(-x / tau))

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.ema.state_dict()[k].mul_(d).add_((1 - d) * v.detach())


class Trainer:
    def __init__(self, cfg):
        self.cfg, self.device, self.amp = cfg, torch.device("cuda"), cfg["amp"]
        self.model = MODELS[cfg["model"]](cfg).to(self.device)
        self.criterion = DetectionLoss(self.model.head, cfg)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg["lr0"], momentum=0.937, nesterov=True)
        self.scaler = torch.cuda.amp.GradScaler(enabled=self.amp)  # expect: AMP009
        self.ema = ModelEMA(self.model)
        self.accumulate = max(round(64 / cfg["batch"]), 1)
        self.last_opt_step = -1

    def optimizer_step(self):
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        self.ema.update(self.model)

    def train_epoch(self, loader, epoch):
        self.model.train()
        nb = len(loader)
        for i, batch in enumerate(loader):
            ni = i + nb * epoch
            imgs = batch["img"].to(self.device, non_blocking=True).float() / 255
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.amp):
                preds = self.model(imgs)
                loss, loss_items = self.criterion(preds, batch)
            self.scaler.scale(loss).backward()
            if ni - self.last_opt_step >= self.accumulate:
                self.optimizer_step()
                self.last_opt_step = ni
            if i % 50 == 0:
                box, cls, dfl = loss_items.tolist()
                print(f"epoch {epoch} iter {i}/{nb} box {box:.3f} cls {cls:.3f} dfl {dfl:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="yolov8n-tal", choices=list(MODELS))
    parser.add_argument("--epochs", type=int, default=100)
    opt = parser.parse_args()
    config = dict(model=opt.model, nc=80, reg_max=16, lr0=0.01, batch=16, amp=True, box=7.5, cls=0.5, dfl=1.5)
    trainer = Trainer(config)
    from dataset import build_loader  # project-local COCO loader
    train_loader = build_loader("coco/train2017", batch_size=config["batch"])
    for ep in range(opt.epochs):
        trainer.train_epoch(train_loader, ep)
