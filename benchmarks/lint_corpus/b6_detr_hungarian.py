"""Compact DETR in one file: ResNet-50 (frozen BN), sine positional encoding, post-norm
transformer, Hungarian matcher and set criterion with auxiliary decoding losses.
    python detr_mini.py --coco_path data/coco_subset --epochs 150 --lr_drop 100 --amp
"""
import argparse
import math
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from scipy.optimize import linear_sum_assignment
from torch import nn
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from torchvision.ops.misc import FrozenBatchNorm2d


class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=128, temperature=10000):
        super().__init__()
        self.num_pos_feats, self.temperature, self.scale = num_pos_feats, temperature, 2 * math.pi

    def forward(self, mask):
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        eps = 1e-6
        y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class Attention(nn.Module):
    """Batch-first multi-head attention with a key padding mask."""

    def __init__(self, d_model, nhead, dropout=0.1):
        super().__init__()
        self.nhead, self.hd = nhead, d_model // nhead
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, query, key, value, key_padding_mask=None):
        B, Lq, C = query.shape
        Lk = key.shape[1]
        q = self.q_proj(query).view(B, Lq, self.nhead, self.hd).transpose(1, 2)
        k = self.k_proj(key).view(B, Lk, self.nhead, self.hd).transpose(1, 2)
        v = self.v_proj(value).view(B, Lk, self.nhead, self.hd).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(attn.softmax(dim=-1))
        return self.out_proj((attn @ v).transpose(1, 2).reshape(B, Lq, C))


class EncoderLayer(nn.Module):
    def __init__(self, d, nhead, ff=2048, dropout=0.1):
        super().__init__()
        self.attn = Attention(d, nhead, dropout)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, src, pos, mask):
        q = k = src + pos
        src = self.norm1(src + self.drop(self.attn(q, k, src, key_padding_mask=mask)))
        return self.norm2(src + self.drop(self.ff(src)))


class DecoderLayer(nn.Module):
    def __init__(self, d, nhead, ff=2048, dropout=0.1):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(d, nhead, dropout), Attention(d, nhead, dropout)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, tgt, memory, pos, query_pos, mask):
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.drop(self.self_attn(q, k, tgt)))
        tgt = self.norm2(tgt + self.drop(self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=mask)))
        return self.norm3(tgt + self.drop(self.ff(tgt)))


class DETR(nn.Module):
    def __init__(self, num_classes, num_queries=100, d_model=256, nhead=8, enc_layers=6, dec_layers=6):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.backbone = IntermediateLayerGetter(backbone, return_layers={"layer4": "0"})
        self.input_proj = nn.Conv2d(2048, d_model, kernel_size=1)
        self.pos = PositionEmbeddingSine(d_model // 2)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, nhead) for _ in range(enc_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model, nhead) for _ in range(dec_layers)])
        self.dec_norm = nn.LayerNorm(d_model)
        self.query_embed = nn.Embedding(num_queries, d_model)
        self.class_embed = nn.Linear(d_model, num_classes + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, 4))

    def forward(self, images, pixel_mask):
        feat = self.backbone(images)["0"]
        mask = F.interpolate(pixel_mask[None].float(), size=feat.shape[-2:])[0].bool()
        pos = self.pos(mask).flatten(2).transpose(1, 2).to(feat.dtype)
        src = self.input_proj(feat).flatten(2).transpose(1, 2)
        mask = mask.flatten(1)
        for layer in self.encoder:
            src = layer(src, pos, mask)
        query_pos = self.query_embed.weight.unsqueeze(0).expand(src.shape[0], -1, -1)
        tgt = torch.zeros_like(query_pos)
        hs = []
        for layer in self.decoder:
            tgt = layer(tgt, src, pos, query_pos, mask)
            hs.append(self.dec_norm(tgt))
        hs = torch.stack(hs)
        logits, boxes = self.class_embed(hs), self.bbox_embed(hs).sigmoid()
        out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])]
        return out


class HungarianMatcher(nn.Module):
    def __init__(self, cost_class=1.0, cost_bbox=5.0, cost_giou=2.0):
        super().__init__()
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def forward(self, outputs, targets):
        bs, nq = outputs["pred_logits"].shape[:2]
        out_prob = outputs["pred_logits"].flatten(0, 1).float().softmax(-1)
        out_bbox = outputs["pred_boxes"].flatten(0, 1).float()
        tgt_ids = torch.cat([v["labels"] for v in targets])
        tgt_bbox = torch.cat([v["boxes"] for v in targets])
        cost_class = -out_prob[:, tgt_ids]
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_convert(out_bbox, "cxcywh", "xyxy"), box_convert(tgt_bbox, "cxcywh", "xyxy"))
        C = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        C = C.view(bs, nq, -1).cpu().numpy()
        C[~np.isfinite(C)] = 1e9  # degenerate boxes: never match them
        sizes = [len(v["boxes"]) for v in targets]
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(np.split(C, np.cumsum(sizes)[:-1], axis=-1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict, eos_coef=0.1, focal=False):
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict, self.focal = num_classes, matcher, weight_dict, focal
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    @staticmethod
    def _src_idx(indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        return batch_idx, torch.cat([src for src, _ in indices])

    def single(self, outputs, targets, num_boxes):
        indices = self.matcher(outputs, targets)
        idx = self._src_idx(indices)
        src_logits = outputs["pred_logits"]
        target_classes = torch.full(src_logits.shape[:2], self.num_classes, dtype=torch.int64, device=src_logits.device)
        target_classes[idx] = torch.cat([t["labels"][J] for t, (_, J) in zip(targets, indices)])
        if self.focal:
            onehot = F.one_hot(target_classes, self.num_classes + 1)[..., :-1].to(src_logits.dtype)
            loss_ce = sigmoid_focal_loss(src_logits[..., :-1], onehot, alpha=0.25, gamma=2.0, reduction="sum") / num_boxes
        else:
            loss_ce = F.cross_entropy(src_logits.transpose(1, 2), target_classes, self.empty_weight)
        src_boxes = outputs["pred_boxes"][idx]
        target_boxes = torch.cat([t["boxes"][J] for t, (_, J) in zip(targets, indices)])
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction="sum") / num_boxes
        giou = generalized_box_iou(box_convert(src_boxes, "cxcywh", "xyxy"), box_convert(target_boxes, "cxcywh", "xyxy"))
        loss_giou = (1 - torch.diag(giou)).sum() / num_boxes
        return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou}

    def forward(self, outputs, targets):
        num_boxes = max(float(sum(len(t["labels"]) for t in targets)), 1.0)
        losses = self.single(outputs, targets, num_boxes)  # final decoder layer
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            losses.update({f"{k}_{i}": v for k, v in self.single(aux, targets, num_boxes).items()})
        return losses


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, scaler=None, max_norm=0.1, print_freq=50):
    model.train()
    criterion.train()
    weight_dict = criterion.weight_dict
    t0 = time.time()
    for it, (images, pixel_mask, targets) in enumerate(data_loader):
        images, pixel_mask = images.to(device, non_blocking=True), pixel_mask.to(device, non_blocking=True)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]

        with torch.cuda.amp.autocast(enabled=scaler is not None):  # expect: AMP009
            outputs = model(images, pixel_mask)
        loss_dict = criterion(outputs, targets)  # expect: AMP002
        losses = sum(loss_dict[k] * weight_dict[k.rsplit("_", 1)[0] if k[-1].isdigit() else k] for k in loss_dict)
        loss_value = losses.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training", {k: v.item() for k, v in loss_dict.items()})
            sys.exit(1)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()  # expect: AMP006

        if it % print_freq == 0:
            print(f"Epoch [{epoch}] [{it}/{len(data_loader)}] loss {loss_value:.4f} ce {loss_dict['loss_ce'].item():.4f} ({time.time() - t0:.1f}s)")


@torch.no_grad()
def evaluate(model, criterion, data_loader, device, use_amp):
    model.eval()
    criterion.eval()
    stats, n = defaultdict(float), 0
    for images, pixel_mask, targets in data_loader:
        images, pixel_mask = images.to(device), pixel_mask.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", enabled=use_amp):
            outputs = model(images, pixel_mask)
        loss_dict = criterion(outputs, targets)  # expect: AMP002
        for k, v in loss_dict.items():
            stats[k] += v.item()
        n += 1
        probs = outputs["pred_logits"].float().softmax(-1)[..., :-1]
        scores, _ = probs.max(-1)
        stats["mean_top_score"] += scores.max(-1).values.mean().item()
    return {k: v / max(n, 1) for k, v in stats.items()}


def collate_fn(batch):
    images, targets = zip(*batch)
    H = max(img.shape[1] for img in images)
    W = max(img.shape[2] for img in images)
    padded = torch.zeros(len(images), 3, H, W)
    pixel_mask = torch.ones(len(images), H, W, dtype=torch.bool)
    for i, img in enumerate(images):
        padded[i, :, : img.shape[1], : img.shape[2]] = img
        pixel_mask[i, : img.shape[1], : img.shape[2]] = False
    return padded, pixel_mask, list(targets)


def main(args):
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = DETR(args.num_classes, num_queries=args.num_queries).to(device)
    weight_dict = {"loss_ce": 1.0, "loss_bbox": args.bbox_loss_coef, "loss_giou": args.giou_loss_coef}
    criterion = SetCriterion(args.num_classes, HungarianMatcher(), weight_dict, eos_coef=args.eos_coef).to(device)
    param_dicts = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad], "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None

    from datasets_coco import build_dataset  # COCO json -> (image tensor, {"labels", "boxes" in cxcywh, normalised})
    train_loader = torch.utils.data.DataLoader(build_dataset("train", args), batch_size=args.batch_size, shuffle=True, collate_fn=collate_fn, num_workers=4)
    val_loader = torch.utils.data.DataLoader(build_dataset("val", args), batch_size=args.batch_size, collate_fn=collate_fn, num_workers=2)

    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, optimizer, device, epoch, scaler=scaler, max_norm=args.clip_max_norm)
        lr_scheduler.step()
        stats = evaluate(model, criterion, val_loader, device, args.amp)
        print(f"epoch {epoch}: " + " ".join(f"{k} {v:.4f}" for k, v in stats.items() if not k[-1].isdigit()))
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None, "epoch": epoch, "args": args}, os.path.join(args.output_dir, "checkpoint.pth"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DETR-mini")
    parser.add_argument("--coco_path", type=str, required=True)
    defaults = dict(num_classes=91, num_queries=100, lr=1e-4, lr_backbone=1e-5, weight_decay=1e-4, batch_size=4, epochs=150,
                    lr_drop=100, clip_max_norm=0.1, bbox_loss_coef=5.0, giou_loss_coef=2.0, eos_coef=0.1)
    for name, value in defaults.items():
        parser.add_argument(f"--{name}", type=type(value), default=value)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default="out/detr-mini")
    main(parser.parse_args())
