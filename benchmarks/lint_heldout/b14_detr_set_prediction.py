"""DETR-style detection: ResNet-50 + transformer, Hungarian matching, aux losses, AMP, DDP."""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from scipy.optimize import linear_sum_assignment
from torch.cuda import amp
from torch.nn.parallel import DistributedDataParallel as DDP

from detr_data import build_coco, collate_fn  # local module


def box_cxcywh_to_xyxy(x):
    x_c, y_c, w, h = x.unbind(-1)
    return torch.stack([x_c - 0.5 * w, y_c - 0.5 * h, x_c + 0.5 * w, y_c + 0.5 * h], dim=-1)


def generalized_box_iou(boxes1, boxes2):
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    wh = (torch.min(boxes1[:, None, 2:], boxes2[:, 2:]) - torch.max(boxes1[:, None, :2], boxes2[:, :2])).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area1[:, None] + area2 - inter
    iou = inter / (union + 1e-7)
    wh_c = (torch.max(boxes1[:, None, 2:], boxes2[:, 2:]) - torch.min(boxes1[:, None, :2], boxes2[:, :2])).clamp(min=0)
    area_c = wh_c[..., 0] * wh_c[..., 1]
    return iou - (area_c - union) / (area_c + 1e-7)


class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=128, temperature=10000):
        super().__init__()
        self.num_pos_feats, self.temperature, self.scale = num_pos_feats, temperature, 2 * math.pi

    def forward(self, mask):
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        y_embed = y_embed / (y_embed[:, -1:, :] + 1e-6) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + 1e-6) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class Attention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, q, k, v, key_padding_mask=None):
        B, Lq, D = q.shape
        q = self.q_proj(q).view(B, Lq, self.heads, -1).transpose(1, 2)
        k = self.k_proj(k).view(B, k.shape[1], self.heads, -1).transpose(1, 2)
        v = self.v_proj(v).view(B, v.shape[1], self.heads, -1).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if key_padding_mask is not None:
            fill = key_padding_mask[:, None, None, :].expand_as(attn)
            attn[fill] = -1e9  # expect: AMP007
        attn = self.drop(attn.softmax(dim=-1))
        return self.out_proj((attn @ v).transpose(1, 2).reshape(B, Lq, D))


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, ff=2048, dropout=0.1):
        super().__init__()
        self.attn = Attention(d, heads, dropout)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, src, mask, pos):
        qk = src + pos
        src = self.norm1(src + self.attn(qk, qk, src, key_padding_mask=mask))
        return self.norm2(src + self.ff(src))


class DecoderLayer(nn.Module):
    def __init__(self, d, heads, ff=2048, dropout=0.1):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(d, heads, dropout), Attention(d, heads, dropout)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, tgt, memory, mask, pos, query_pos):
        q = tgt + query_pos
        tgt = self.norm1(tgt + self.self_attn(q, q, tgt))
        tgt = self.norm2(tgt + self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=mask))
        return self.norm3(tgt + self.ff(tgt))


class DETR(nn.Module):
    def __init__(self, num_classes, num_queries=100, d=256, heads=8, enc_layers=6, dec_layers=6):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(backbone.children())[:-2])
        self.input_proj = nn.Conv2d(2048, d, kernel_size=1)
        self.position = PositionEmbeddingSine(d // 2)
        self.query_embed = nn.Embedding(num_queries, d)
        self.encoder = nn.ModuleList([EncoderLayer(d, heads) for _ in range(enc_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d, heads) for _ in range(dec_layers)])
        self.dec_norm = nn.LayerNorm(d)
        self.class_embed = nn.Linear(d, num_classes + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, images, mask):
        feat = self.backbone(images)
        mask = F.interpolate(mask[None].float(), size=feat.shape[-2:])[0].to(torch.bool)
        pos = self.position(mask).flatten(2).transpose(1, 2)
        src = self.input_proj(feat).flatten(2).transpose(1, 2)
        mask = mask.flatten(1)
        for layer in self.encoder:
            src = layer(src, mask, pos)
        query_pos = self.query_embed.weight[None].expand(src.shape[0], -1, -1)
        tgt, hs = torch.zeros_like(query_pos), []
        for layer in self.decoder:
            tgt = layer(tgt, src, mask, pos, query_pos)
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
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_bbox = torch.cat([t["boxes"] for t in targets])
        C = (self.cost_bbox * torch.cdist(out_bbox, tgt_bbox, p=1) - self.cost_class * out_prob[:, tgt_ids]
             - self.cost_giou * generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox)))
        C = C.view(bs, nq, -1).cpu()
        C[~torch.isfinite(C)] = 1e9
        idx = [linear_sum_assignment(c[i]) for i, c in enumerate(C.split([len(t["boxes"]) for t in targets], -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in idx]


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict, eos_coef=0.1):
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict = num_classes, matcher, weight_dict
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    @staticmethod
    def _src_idx(indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        return batch_idx, torch.cat([src for src, _ in indices])

    def _losses(self, outputs, targets, indices, num_boxes):
        idx = self._src_idx(indices)
        src_logits = outputs["pred_logits"]
        target_classes = torch.full(src_logits.shape[:2], self.num_classes, dtype=torch.int64, device=src_logits.device)
        target_classes[idx] = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)])
        loss_ce = F.cross_entropy(src_logits.transpose(1, 2), target_classes, self.empty_weight)
        src_boxes = outputs["pred_boxes"][idx]
        tgt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, tgt_boxes, reduction="none").sum() / num_boxes
        giou = torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes), box_cxcywh_to_xyxy(tgt_boxes)))
        return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": (1 - giou).sum() / num_boxes}

    def forward(self, outputs, targets):
        num_boxes = torch.as_tensor([float(sum(len(t["labels"]) for t in targets))], device=outputs["pred_logits"].device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(num_boxes)
            num_boxes = num_boxes / dist.get_world_size()
        num_boxes = num_boxes.clamp(min=1).item()
        losses = self._losses(outputs, targets, self.matcher(outputs, targets), num_boxes)
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            aux_l = self._losses(aux, targets, self.matcher(aux, targets), num_boxes)
            losses.update({f"{k}_{i}": v for k, v in aux_l.items()})
        return losses


def pad_images(images):
    h = max(img.shape[1] for img in images)
    w = max(img.shape[2] for img in images)
    batch = images[0].new_zeros((len(images), 3, h, w))
    mask = torch.ones((len(images), h, w), dtype=torch.bool, device=images[0].device)
    for img, pad_img, m in zip(images, batch, mask):
        pad_img[:, : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], : img.shape[2]] = False
    return batch, mask


def optimizer_step(model, optimizer, scaler, max_norm):
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()


def train_one_epoch(model, criterion, loader, optimizer, scaler, device, epoch, max_norm, use_amp):
    model.train()
    t0 = time.time()
    for it, (images, targets) in enumerate(loader):
        images = [img.to(device, non_blocking=True).half() for img in images]  # expect: AMP001
        samples, mask = pad_images(images)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            outputs = model(samples, mask)
        loss_dict = criterion(outputs, targets)  # expect: AMP002
        losses = sum(loss_dict[k] * criterion.weight_dict[k] for k in loss_dict if k in criterion.weight_dict)
        loss_value = losses.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value}: {({k: v.item() for k, v in loss_dict.items()})}")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(losses).backward()
        optimizer_step(model, optimizer, scaler, max_norm)
        if it % 50 == 0:
            print(f"epoch {epoch} it {it} loss {loss_value:.4f} scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s")


@torch.no_grad()
def evaluate(model, criterion, loader, device, use_amp):
    model.eval()
    total, n = 0.0, 0
    for images, targets in loader:
        samples, mask = pad_images([img.to(device) for img in images])
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            outputs = model(samples, mask)
            loss_dict = criterion(outputs, targets)
        total, n = total + sum(loss_dict[k] * criterion.weight_dict[k] for k in loss_dict if k in criterion.weight_dict).item(), n + 1
    return total / max(1, n)


def main(args):
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda")
    model = model_without_ddp = DETR(num_classes=91, num_queries=args.num_queries).to(device)
    if distributed:
        model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])])
    weight_dict = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}
    weight_dict.update({f"{k}_{i}": v for i in range(5) for k, v in list(weight_dict.items())})
    criterion = SetCriterion(91, HungarianMatcher(), weight_dict).to(device)
    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2 * args.epochs // 3)
    scaler = amp.GradScaler(enabled=args.amp)  # expect: AMP009
    train_set, val_set = build_coco(args.coco_path, "train"), build_coco(args.coco_path, "val")
    sampler = torch.utils.data.DistributedSampler(train_set) if distributed else torch.utils.data.RandomSampler(train_set)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                                         collate_fn=collate_fn, num_workers=4, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size, collate_fn=collate_fn, num_workers=2)
    for epoch in range(args.epochs):
        if distributed:
            sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, loader, optimizer, scaler, device, epoch, args.clip_max_norm, args.amp)
        lr_scheduler.step()
        val_loss = evaluate(model, criterion, val_loader, device, args.amp)
        if not distributed or dist.get_rank() == 0:
            print(f"epoch {epoch} val loss {val_loss:.4f}")
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.output_dir, "checkpoint.pth"))


if __name__ == "__main__":
    p = argparse.ArgumentParser("DETR")
    p.add_argument("--coco-path", required=True)
    p.add_argument("--output-dir", default="runs/detr")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-backbone", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--clip-max-norm", type=float, default=0.1)
    p.add_argument("--num-queries", type=int, default=100)
    p.add_argument("--amp", action="store_true")
    a = p.parse_args()
    os.makedirs(a.output_dir, exist_ok=True)
    main(a)
