"""DETR-style set prediction: ResNet-50 + transformer, Hungarian matching, focal/L1/GIoU losses.

``build`` returns the model and its criterion (as in the DETR code base); the model output is
a dataclass. Trained with fp16 autocast and a GradScaler, gradient clipping at 0.1.
"""
import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from scipy.optimize import linear_sum_assignment


def box_cxcywh_to_xyxy(x):
    cx, cy, w, h = x.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def generalized_box_iou(boxes1, boxes2):
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area1[:, None] + area2 - inter
    iou = inter / (union + 1e-7)
    lt = torch.min(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.max(boxes1[:, None, 2:], boxes2[:, 2:])
    area = (rb - lt).clamp(min=0).prod(-1)
    return iou - (area - union) / (area + 1e-7)


@dataclass
class DetrOutput:
    pred_logits: torch.Tensor
    pred_boxes: torch.Tensor


class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=128, temperature=10000, scale=2 * math.pi):
        super().__init__()
        self.num_pos_feats, self.temperature, self.scale = num_pos_feats, temperature, scale

    def forward(self, mask):
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        eps = 1e-6
        y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale
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
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < len(self.layers) - 1 else layer(x)
        return x


class DETR(nn.Module):
    def __init__(self, backbone, num_classes, num_queries=100, hidden_dim=256, nheads=8, num_layers=6):
        super().__init__()
        self.backbone = backbone
        self.input_proj = nn.Conv2d(2048, hidden_dim, kernel_size=1)
        self.position = PositionEmbeddingSine(hidden_dim // 2)
        self.transformer = nn.Transformer(hidden_dim, nheads, num_layers, num_layers, dim_feedforward=2048)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.class_embed = nn.Linear(hidden_dim, num_classes)
        self.bbox_embed = MLP(hidden_dim, hidden_dim, 4, 3)

    def forward(self, images, pad_mask):
        src = self.input_proj(self.backbone(images))
        mask = F.interpolate(pad_mask[:, None].float(), size=src.shape[-2:])[:, 0].bool()
        pos = self.position(mask).flatten(2).permute(2, 0, 1)
        src = src.flatten(2).permute(2, 0, 1)
        query = self.query_embed.weight.unsqueeze(1).repeat(1, src.size(1), 1)
        hs = self.transformer(src + pos, query, src_key_padding_mask=mask.flatten(1),
                              memory_key_padding_mask=mask.flatten(1)).transpose(0, 1)
        return DetrOutput(pred_logits=self.class_embed(hs), pred_boxes=self.bbox_embed(hs).sigmoid())


class HungarianMatcher(nn.Module):
    def __init__(self, cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, alpha=0.25, gamma=2.0):
        super().__init__()
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.alpha, self.gamma = alpha, gamma

    @torch.no_grad()
    def forward(self, outputs, targets):
        bs, num_queries = outputs.pred_logits.shape[:2]
        out_prob = outputs.pred_logits.flatten(0, 1).sigmoid()
        out_bbox = outputs.pred_boxes.flatten(0, 1)
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_bbox = torch.cat([t["boxes"] for t in targets])
        neg_cost = (1 - self.alpha) * (out_prob ** self.gamma) * (-(1 - out_prob + 1e-8).log())  # expect: AMP011
        pos_cost = self.alpha * ((1 - out_prob) ** self.gamma) * (-(out_prob + 1e-8).log())  # expect: AMP011
        cost_class = pos_cost[:, tgt_ids] - neg_cost[:, tgt_ids]
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
        c = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        c = c.view(bs, num_queries, -1).float().cpu()
        sizes = [len(t["boxes"]) for t in targets]
        indices = [linear_sum_assignment(m[i].numpy()) for i, m in enumerate(c.split(sizes, -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


def sigmoid_focal_loss(inputs, targets, num_boxes, alpha=0.25, gamma=2.0):
    prob = inputs.sigmoid()
    ce_loss = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce_loss * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).mean(1).sum() / num_boxes


class SetCriterion(nn.Module):
    def __init__(self, num_classes, weight_dict, focal_alpha=0.25, matcher_costs=None):
        super().__init__()
        self.num_classes = num_classes
        self.matcher = HungarianMatcher(**(matcher_costs or {}))
        self.weight_dict, self.focal_alpha = weight_dict, focal_alpha

    @staticmethod
    def _src_permutation_idx(indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        return batch_idx, torch.cat([src for src, _ in indices])

    def loss_labels(self, outputs, targets, indices, num_boxes):
        logits = outputs.pred_logits
        idx = self._src_permutation_idx(indices)
        classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        classes[idx] = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)])
        onehot = F.one_hot(classes, self.num_classes + 1)[..., :-1].float()
        return {"loss_ce": sigmoid_focal_loss(logits, onehot, num_boxes, self.focal_alpha) * logits.shape[1]}

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        idx = self._src_permutation_idx(indices)
        src_boxes = outputs.pred_boxes[idx]
        tgt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, tgt_boxes, reduction="none")
        giou = torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes), box_cxcywh_to_xyxy(tgt_boxes)))
        return {"loss_bbox": loss_bbox.sum() / num_boxes, "loss_giou": (1 - giou).sum() / num_boxes}

    def forward(self, outputs, targets):
        indices = self.matcher(outputs, targets)
        num_boxes = max(float(sum(len(t["labels"]) for t in targets)), 1.0)
        losses = self.loss_labels(outputs, targets, indices, num_boxes)
        losses.update(self.loss_boxes(outputs, targets, indices, num_boxes))
        return losses


def build(args):
    resnet = torchvision.models.resnet50(weights="IMAGENET1K_V1")
    backbone = nn.Sequential(*list(resnet.children())[:-2])
    model = DETR(backbone, num_classes=args.num_classes, num_queries=args.num_queries)
    weight_dict = {"loss_ce": 2.0, "loss_bbox": 5.0, "loss_giou": 2.0}
    costs = {"cost_class": 2.0, "cost_bbox": 5.0, "cost_giou": 2.0}
    return model, SetCriterion(args.num_classes, weight_dict, matcher_costs=costs)


def train_one_epoch(model, criterion, loader, optimizer, scaler, device, max_norm=0.1):
    model.train()
    criterion.train()
    for images, pad_mask, targets in loader:
        images, pad_mask = images.to(device, non_blocking=True), pad_mask.to(device, non_blocking=True)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images, pad_mask)
            loss_dict = criterion(outputs, targets)
            losses = sum(loss_dict[k] * criterion.weight_dict[k] for k in loss_dict if k in criterion.weight_dict)
        optimizer.zero_grad()
        scaler.scale(losses).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num-classes", type=int, default=91)
    p.add_argument("--num-queries", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-backbone", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--clip-max-norm", type=float, default=0.1)
    args = p.parse_args()
    device = torch.device("cuda")
    model, criterion = build(args)
    model.to(device)
    model = torch.compile(model)
    param_dicts = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 200)
    scaler = torch.amp.GradScaler("cuda")
    loader = torch.load("cache/coco_train_loader.pt")
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, loader, optimizer, scaler, device, args.clip_max_norm)
        lr_scheduler.step()
        torch.save({"model": model.state_dict(), "epoch": epoch}, "detr_checkpoint.pth")


if __name__ == "__main__":
    main()
