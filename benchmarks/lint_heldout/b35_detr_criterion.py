"""DETR-style detector with an IoU-aware quality branch, Hungarian matching and set criterion.

Losses follow mmdetection conventions (``reduction`` / ``reduction_override`` and a
shared ``reduce_loss`` helper); ``DetectorWithLoss`` returns the weighted total.
"""
import math
from dataclasses import dataclass, field
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment


@dataclass
class DetrConfig:
    backbone: str = "small"
    hidden_dim: int = 256
    nheads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1
    num_queries: int = 100
    num_classes: int = 91
    matcher: Dict[str, float] = field(default_factory=lambda: {"cost_class": 2.0, "cost_bbox": 5.0, "cost_giou": 2.0})
    weight_dict: Dict[str, float] = field(default_factory=lambda: {"loss_ce": 2.0, "loss_bbox": 5.0, "loss_giou": 2.0, "loss_quality": 1.0})


@dataclass
class DetrOutput:
    pred_logits: torch.Tensor
    pred_boxes: torch.Tensor
    pred_quality: torch.Tensor


def box_cxcywh_to_xyxy(x):
    cx, cy, w, h = x.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def box_iou(boxes1, boxes2, eps=1e-7):
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area1[:, None] + area2 - inter
    return inter / (union + eps), union


def generalized_box_iou(boxes1, boxes2, eps=1e-7):
    iou, union = box_iou(boxes1, boxes2, eps)
    lt = torch.min(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.max(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    area = wh[..., 0] * wh[..., 1]
    return iou - (area - union) / (area + eps)


class FrozenBatchNorm2d(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        for name, init in (("weight", torch.ones), ("bias", torch.zeros), ("running_mean", torch.zeros), ("running_var", torch.ones)):
            self.register_buffer(name, init(n))
        self.eps = eps

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale[None, :, None, None] + bias[None, :, None, None]


class ConvBlock(nn.Sequential):
    def __init__(self, cin, cout, stride):
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), FrozenBatchNorm2d(cout), nn.ReLU(inplace=True))


class Backbone(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512)):
        super().__init__()
        layers, cin = [ConvBlock(3, widths[0], 2)], widths[0]
        for w in widths:
            layers += [ConvBlock(cin, w, 2), ConvBlock(w, w, 1)]
            cin = w
        self.body = nn.Sequential(*layers)
        self.num_channels = cin

    def forward(self, x):
        return self.body(x)


BACKBONES = {"tiny": lambda: Backbone((32, 64, 128, 256)), "small": lambda: Backbone()}


class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=128, temperature=10000, scale=2 * math.pi):
        super().__init__()
        self.num_pos_feats, self.temperature, self.scale = num_pos_feats, temperature, scale

    def forward(self, mask):
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        y_embed = y_embed / (y_embed[:, -1:, :] + 1e-6) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + 1e-6) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x, pos_y = x_embed[..., None] / dim_t, y_embed[..., None] / dim_t
        pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class MLP(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class DETR(nn.Module):
    def __init__(self, cfg: DetrConfig):
        super().__init__()
        self.backbone = BACKBONES[cfg.backbone]()
        self.position_embedding = PositionEmbeddingSine(cfg.hidden_dim // 2)
        self.input_proj = nn.Conv2d(self.backbone.num_channels, cfg.hidden_dim, kernel_size=1)
        self.query_embed = nn.Embedding(cfg.num_queries, cfg.hidden_dim)
        enc_layer = nn.TransformerEncoderLayer(cfg.hidden_dim, cfg.nheads, cfg.dim_feedforward, cfg.dropout, batch_first=True)
        dec_layer = nn.TransformerDecoderLayer(cfg.hidden_dim, cfg.nheads, cfg.dim_feedforward, cfg.dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, cfg.enc_layers)
        self.decoder = nn.TransformerDecoder(dec_layer, cfg.dec_layers, norm=nn.LayerNorm(cfg.hidden_dim))
        self.class_embed = nn.Linear(cfg.hidden_dim, cfg.num_classes)
        self.bbox_embed = MLP(cfg.hidden_dim, cfg.hidden_dim, 4, 3)
        self.quality_embed = nn.Linear(cfg.hidden_dim, 1)

    def forward(self, images, pixel_mask) -> DetrOutput:
        feats = self.backbone(images)
        mask = F.interpolate(pixel_mask[:, None].float(), size=feats.shape[-2:]).to(torch.bool)[:, 0]
        pos = self.position_embedding(mask).flatten(2).transpose(1, 2)
        memory = self.encoder(self.input_proj(feats).flatten(2).transpose(1, 2) + pos, src_key_padding_mask=mask.flatten(1))
        tgt = self.query_embed.weight.unsqueeze(0).expand(images.shape[0], -1, -1)
        hs = self.decoder(tgt, memory, memory_key_padding_mask=mask.flatten(1))
        return DetrOutput(
            pred_logits=self.class_embed(hs),
            pred_boxes=self.bbox_embed(hs).sigmoid(),
            pred_quality=self.quality_embed(hs).squeeze(-1),
        )


class HungarianMatcher(nn.Module):
    def __init__(self, cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, alpha=0.25, gamma=2.0):
        super().__init__()
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.alpha, self.gamma = alpha, gamma

    @torch.no_grad()
    def forward(self, pred_logits, pred_boxes, targets):
        bs, num_queries = pred_logits.shape[:2]
        out_prob = pred_logits.flatten(0, 1).sigmoid()
        out_bbox = pred_boxes.flatten(0, 1).float()
        tgt_ids = torch.cat([v["labels"] for v in targets])
        tgt_bbox = torch.cat([v["boxes"] for v in targets])
        neg_cost = (1 - self.alpha) * (out_prob ** self.gamma) * (-(1 - out_prob + 1e-8).log())  # expect: AMP011
        pos_cost = self.alpha * ((1 - out_prob) ** self.gamma) * (-(out_prob + 1e-8).log())  # expect: AMP011
        cost_class = pos_cost[:, tgt_ids] - neg_cost[:, tgt_ids]
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
        C = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        C = C.view(bs, num_queries, -1).cpu()
        sizes = [len(v["boxes"]) for v in targets]
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(C.split(sizes, -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


def reduce_loss(loss, reduction):
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()  # expect: AMP004
    return loss.sum()


def l1_loss(pred, target, reduction="mean"):
    if target.numel() == 0:
        return pred.sum() * 0
    loss = (pred - target.to(pred.dtype)).abs()
    return reduce_loss(loss, reduction)


class L1Loss(nn.Module):
    def __init__(self, reduction="mean", loss_weight=1.0):
        super().__init__()
        self.reduction, self.loss_weight = reduction, loss_weight

    def forward(self, pred, target, reduction_override=None):
        reduction = reduction_override if reduction_override else self.reduction
        return self.loss_weight * l1_loss(pred, target, reduction=reduction)


def sigmoid_focal_loss(inputs, targets, num_boxes, alpha=0.25, gamma=2.0):
    prob = inputs.sigmoid()
    ce_loss = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce_loss * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.mean(1).sum() / num_boxes


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher_cfg, focal_alpha=0.25):
        super().__init__()
        self.num_classes = num_classes
        self.matcher = HungarianMatcher(**matcher_cfg)
        self.focal_alpha = focal_alpha
        self.l1 = L1Loss(reduction="mean")

    @staticmethod
    def _get_src_permutation_idx(indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        return batch_idx, torch.cat([src for (src, _) in indices])

    def loss_labels(self, pred_logits, targets, indices, num_boxes):
        idx = self._get_src_permutation_idx(indices)
        classes = torch.cat([t["labels"][J] for t, (_, J) in zip(targets, indices)])
        onehot = torch.zeros_like(pred_logits, dtype=torch.float32)
        onehot[idx[0], idx[1], classes] = 1.0
        return {"loss_ce": sigmoid_focal_loss(pred_logits, onehot, num_boxes, alpha=self.focal_alpha)}

    def loss_boxes(self, pred_boxes, targets, indices, num_boxes):
        idx = self._get_src_permutation_idx(indices)
        src_boxes = pred_boxes[idx]
        target_boxes = torch.cat([t["boxes"][i] for t, (i, _) in zip(targets, indices)], dim=0)
        loss_giou = 1 - torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes.float()), box_cxcywh_to_xyxy(target_boxes)))
        return {"loss_bbox": self.l1(src_boxes, target_boxes), "loss_giou": loss_giou.sum() / num_boxes}

    def loss_quality(self, pred_quality, pred_boxes, targets, indices):
        """IoU-aware branch: matched queries predict the IoU of their box with the target."""
        idx = self._get_src_permutation_idx(indices)
        with torch.no_grad():
            target_boxes = torch.cat([t["boxes"][i] for t, (i, _) in zip(targets, indices)], dim=0)
            ious = torch.diag(box_iou(box_cxcywh_to_xyxy(pred_boxes[idx].float()), box_cxcywh_to_xyxy(target_boxes))[0])
        quality_target = torch.zeros_like(pred_quality, dtype=torch.float32)
        quality_target[idx] = ious
        prob = pred_quality.sigmoid()
        return {"loss_quality": F.binary_cross_entropy(prob, quality_target)}  # expect: AMP003

    def forward(self, pred_logits, pred_boxes, pred_quality, targets):
        indices = self.matcher(pred_logits, pred_boxes, targets)
        num_boxes = max(sum(len(t["labels"]) for t in targets), 1)
        losses = {}
        losses.update(self.loss_labels(pred_logits, targets, indices, num_boxes))
        losses.update(self.loss_boxes(pred_boxes, targets, indices, num_boxes))
        losses.update(self.loss_quality(pred_quality, pred_boxes, targets, indices))
        with torch.no_grad():
            losses["quality_mean"] = pred_quality.sigmoid().mean()  # expect: AMP004
        return losses


class DetectorWithLoss(nn.Module):
    def __init__(self, cfg: DetrConfig):
        super().__init__()
        self.detector = DETR(cfg)
        self.criterion = SetCriterion(cfg.num_classes, cfg.matcher)
        self.weight_dict = cfg.weight_dict

    def forward(self, images, pixel_mask, targets):
        out = self.detector(images, pixel_mask)
        loss_dict = self.criterion(out.pred_logits, out.pred_boxes, out.pred_quality, targets)
        total = sum(loss_dict[k] * w for k, w in self.weight_dict.items() if k in loss_dict)
        return total, loss_dict


def train_one_epoch(model, loader, optimizer, scaler, device, max_norm=0.1):
    model.train()
    for images, pixel_mask, targets in loader:
        images, pixel_mask = images.to(device, non_blocking=True), pixel_mask.to(device, non_blocking=True)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.float16):
            loss, loss_dict = model(images, pixel_mask, targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if max_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def evaluate(detector, loader, device, score_thr=0.3):
    detector.eval()
    results = []
    for images, pixel_mask, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = detector(images.to(device), pixel_mask.to(device))
        scores, _ = out.pred_logits.sigmoid().max(-1)
        results += [(b[s > score_thr].float().cpu(), s[s > score_thr].float().cpu()) for b, s in zip(out.pred_boxes, scores)]
    return results


def main(cfg: DetrConfig, loader, epochs=50, lr=1e-4, lr_backbone=1e-5, device="cuda"):
    model = DetectorWithLoss(cfg).to(device)
    param_groups = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad], "lr": lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=lr, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        train_one_epoch(model, loader, optimizer, scaler, device)
    return model
