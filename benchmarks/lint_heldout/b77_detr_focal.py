"""DETR with sigmoid focal classification: transformer, Hungarian matcher, set criterion
and the training engine (detection, then an optional foreground-mask head stage).
"""
import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn

import util.misc as utils
from datasets import build_dataset
from models.backbone import build_backbone


def box_cxcywh_to_xyxy(x):
    cx, cy, w, h = x.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def generalized_box_iou(boxes1, boxes2, eps=1e-7):
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area1[:, None] + area2 - inter
    iou = inter / (union + eps)
    lt_c = torch.min(boxes1[:, None, :2], boxes2[:, :2])
    rb_c = torch.max(boxes1[:, None, 2:], boxes2[:, 2:])
    wh_c = (rb_c - lt_c).clamp(min=0)
    area_c = wh_c[..., 0] * wh_c[..., 1]
    return iou - (area_c - union) / (area_c + eps)


class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=128, temperature=10000):
        super().__init__()
        self.num_pos_feats, self.temperature = num_pos_feats, temperature
        self.scale = 2 * math.pi

    def forward(self, mask):
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        eps = 1e-6
        y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x, pos_y = x_embed[:, :, :, None] / dim_t, y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.1):
        super().__init__()
        self.nhead, self.head_dim = nhead, d_model // nhead
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.nhead, self.head_dim).transpose(1, 2)

    def forward(self, query, key, value, key_padding_mask=None):
        q, k, v = self._split(self.q_proj(query)), self._split(self.k_proj(key)), self._split(self.v_proj(value))
        attn = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.dropout(attn.softmax(dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).flatten(2)
        return self.out_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_ff, dropout):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.cross_attn = MultiHeadAttention(d_model, nhead, dropout)
        self.ffn = nn.Sequential(nn.Linear(d_model, dim_ff), nn.ReLU(inplace=True), nn.Dropout(dropout),
                                 nn.Linear(dim_ff, d_model))
        self.norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(3)])

    def forward(self, tgt, memory, pos, query_pos, memory_mask):
        q = k = tgt + query_pos
        tgt = self.norms[0](tgt + self.self_attn(q, k, tgt, need_weights=False)[0])
        tgt = self.norms[1](tgt + self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=memory_mask))
        return self.norms[2](tgt + self.ffn(tgt))


class DETR(nn.Module):
    def __init__(self, backbone, num_classes, num_queries=100, d_model=256, nhead=8, enc_layers=6,
                 dec_layers=6, dim_ff=2048, dropout=0.1, aux_loss=True):
        super().__init__()
        self.backbone, self.aux_loss = backbone, aux_loss
        self.input_proj = nn.Conv2d(backbone.num_channels, d_model, 1)
        self.pos_embed = PositionEmbeddingSine(d_model // 2)
        enc_layer = nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, enc_layers, enable_nested_tensor=False)
        self.decoder = nn.ModuleList(DecoderLayer(d_model, nhead, dim_ff, dropout) for _ in range(dec_layers))
        self.dec_norm = nn.LayerNorm(d_model)
        self.query_embed = nn.Embedding(num_queries, d_model)
        self.class_embed = nn.Linear(d_model, num_classes)
        self.bbox_embed = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(inplace=True),
                                        nn.Linear(d_model, d_model), nn.ReLU(inplace=True), nn.Linear(d_model, 4))
        prior = 0.01
        nn.init.constant_(self.class_embed.bias, -math.log((1 - prior) / prior))

    def extract_features(self, samples):
        features = self.backbone(samples)
        src, mask = features[-1].decompose()
        return self.input_proj(src), mask

    def forward(self, samples):
        src, mask = self.extract_features(samples)
        pos = self.pos_embed(mask).flatten(2).transpose(1, 2)
        memory, mask = src.flatten(2).transpose(1, 2), mask.flatten(1)
        memory = self.encoder(memory + pos, src_key_padding_mask=mask)
        query_pos = self.query_embed.weight.unsqueeze(0).expand(memory.size(0), -1, -1)
        tgt, hs = torch.zeros_like(query_pos), []
        for layer in self.decoder:
            tgt = layer(tgt, memory, pos, query_pos, mask)
            hs.append(self.dec_norm(tgt))
        outputs_class = [self.class_embed(h) for h in hs]
        outputs_coord = [self.bbox_embed(h).sigmoid() for h in hs]
        out = {"pred_logits": outputs_class[-1], "pred_boxes": outputs_coord[-1]}
        if self.aux_loss:
            out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(outputs_class[:-1], outputs_coord[:-1])]
        return out


class MaskHead(nn.Module):
    """Class-agnostic foreground mask predicted from the projected backbone features."""

    def __init__(self, d_model, hidden=128):
        super().__init__()
        self.conv1 = nn.Conv2d(d_model, hidden, 3, padding=1)
        self.conv2 = nn.Conv2d(hidden, hidden, 3, padding=1)
        self.gn1, self.gn2 = nn.GroupNorm(8, hidden), nn.GroupNorm(8, hidden)
        self.out = nn.Conv2d(hidden, 1, 1)

    def forward(self, x):
        x = F.relu(self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x))))))
        return self.out(x)


class HungarianMatcher(nn.Module):
    def __init__(self, cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, alpha=0.25, gamma=2.0):
        super().__init__()
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.alpha, self.gamma = alpha, gamma

    @torch.no_grad()
    def forward(self, outputs, targets):
        bs, num_queries = outputs["pred_logits"].shape[:2]
        out_prob = outputs["pred_logits"].flatten(0, 1).float().sigmoid()
        out_bbox = outputs["pred_boxes"].flatten(0, 1).float()
        tgt_ids = torch.cat([v["labels"] for v in targets])
        tgt_bbox = torch.cat([v["boxes"] for v in targets])
        neg_cost = (1 - self.alpha) * (out_prob ** self.gamma) * (-(1 - out_prob + 1e-8).log())
        pos_cost = self.alpha * ((1 - out_prob) ** self.gamma) * (-(out_prob + 1e-8).log())
        cost_class = pos_cost[:, tgt_ids] - neg_cost[:, tgt_ids]
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
        C = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        C = C.view(bs, num_queries, -1).cpu().numpy()
        C[~np.isfinite(C)] = 1e9
        sizes = [len(v["boxes"]) for v in targets]
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(np.split(C, np.cumsum(sizes)[:-1], axis=-1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


def sigmoid_focal_loss(inputs, targets, num_boxes, alpha=0.25, gamma=2.0):
    prob = inputs.sigmoid()
    ce_loss = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce_loss * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).mean(1).sum() / num_boxes


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict, focal_alpha=0.25):
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict = num_classes, matcher, weight_dict
        self.focal_alpha = focal_alpha

    @staticmethod
    def _src_idx(indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        return batch_idx, torch.cat([src for src, _ in indices])

    def loss_labels(self, outputs, targets, indices, num_boxes):
        src_logits = outputs["pred_logits"]
        idx = self._src_idx(indices)
        target_classes_o = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)])
        onehot = torch.zeros_like(src_logits)
        onehot[idx[0], idx[1], target_classes_o] = 1.0
        return {"loss_ce": sigmoid_focal_loss(src_logits, onehot, num_boxes, self.focal_alpha) * src_logits.shape[1]}

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        idx = self._src_idx(indices)
        src_boxes = outputs["pred_boxes"][idx]
        target_boxes = torch.cat([t["boxes"][i] for t, (_, i) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction="none")
        loss_giou = 1 - torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes), box_cxcywh_to_xyxy(target_boxes)))
        return {"loss_bbox": loss_bbox.sum() / num_boxes, "loss_giou": loss_giou.sum() / num_boxes}

    def forward(self, outputs, targets):
        num_boxes = max(utils.all_reduce_mean(sum(len(t["labels"]) for t in targets)), 1.0)
        indices = self.matcher(outputs, targets)
        losses = {**self.loss_labels(outputs, targets, indices, num_boxes),
                  **self.loss_boxes(outputs, targets, indices, num_boxes)}
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            indices = self.matcher(aux, targets)
            for fn in (self.loss_labels, self.loss_boxes):
                losses.update({k + f"_{i}": v for k, v in fn(aux, targets, indices, num_boxes).items()})
        return losses


def build_model(args):
    backbone = build_backbone(args)
    model = DETR(backbone, args.num_classes, args.num_queries, args.hidden_dim, args.nheads,
                 args.enc_layers, args.dec_layers, args.dim_feedforward, args.dropout, aux_loss=True)
    matcher = HungarianMatcher(args.set_cost_class, args.set_cost_bbox, args.set_cost_giou)
    weight_dict = {"loss_ce": args.cls_loss_coef, "loss_bbox": args.bbox_loss_coef, "loss_giou": args.giou_loss_coef}
    for i in range(args.dec_layers - 1):
        weight_dict.update({k + f"_{i}": v for k, v in list(weight_dict.items())[:3]})
    criterion = SetCriterion(args.num_classes, matcher, weight_dict)
    return model, criterion


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, scaler, max_norm=0.0, amp=True):
    model.train()
    criterion.train()
    metric_logger = utils.MetricLogger(delimiter="  ")
    for samples, targets in metric_logger.log_every(data_loader, 10, f"Epoch: [{epoch}]"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp):
            outputs = model(samples)
        loss_dict = criterion(outputs, targets)  # expect: AMP002
        weight_dict = criterion.weight_dict
        losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)

        loss_dict_reduced = utils.reduce_dict(loss_dict)
        losses_reduced_scaled = sum(v * weight_dict[k] for k, v in loss_dict_reduced.items() if k in weight_dict)
        loss_value = losses_reduced_scaled.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training", loss_dict_reduced)
            sys.exit(1)
        optimizer.zero_grad()
        scaler.scale(losses).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        metric_logger.update(loss=loss_value, lr=optimizer.param_groups[0]["lr"], **loss_dict_reduced)
    metric_logger.synchronize_between_processes()
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


@torch.no_grad()
def evaluate(model, criterion, data_loader, device, amp=True):
    model.eval()
    criterion.eval()
    metric_logger = utils.MetricLogger(delimiter="  ")
    for samples, targets in metric_logger.log_every(data_loader, 10, "Test:"):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp):
            outputs = model(samples)
            loss_dict = criterion(outputs, targets)
        weight_dict = criterion.weight_dict
        loss_dict_reduced = utils.reduce_dict(loss_dict)
        metric_logger.update(loss=sum(v * weight_dict[k] for k, v in loss_dict_reduced.items() if k in weight_dict),
                             **loss_dict_reduced)
    metric_logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in metric_logger.meters.items()}


def train_mask_head(args, detector, data_loader):
    """Second stage: freeze the detector, fit a foreground-mask head on its projected features."""
    device = torch.device(args.device)
    detector.eval()
    detector.requires_grad_(False)
    mask_head = MaskHead(args.hidden_dim).to(device)
    optimizer = torch.optim.AdamW(mask_head.parameters(), lr=args.lr_mask, weight_decay=1e-4)
    for epoch in range(args.mask_epochs):
        mask_head.train()
        for it, (samples, targets) in enumerate(data_loader):
            samples = samples.to(device)
            with torch.no_grad():
                feats, _ = detector.extract_features(samples)
            gt = torch.stack([t["masks"].any(dim=0) for t in targets]).to(device)
            gt = F.interpolate(gt[:, None].float(), size=feats.shape[-2:], mode="nearest")
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                probs = mask_head(feats).sigmoid()
                loss_bce = -(gt * torch.log(probs + 1e-8) + (1 - gt) * torch.log(1 - probs + 1e-8))  # expect: AMP011
                inter = (probs * gt).flatten(1).sum(-1)
                loss_dice = 1 - (2 * inter + 1) / (probs.flatten(1).sum(-1) + gt.flatten(1).sum(-1) + 1)
                loss = loss_bce.mean() + loss_dice.mean()
                loss.backward()  # expect: AMP008
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if it % 50 == 0:
                print(f"mask epoch {epoch} it {it} loss {loss.item():.4f}")
    return mask_head


@torch.no_grad()
def export_onnx(model, path, image_size=(800, 1216)):
    model = model.eval().half()
    dummy = torch.randn(1, 3, *image_size, device="cuda", dtype=torch.float16)
    torch.onnx.export(model, (dummy,), path, opset_version=17, input_names=["images"],
                      output_names=["pred_logits", "pred_boxes"])


DEFAULTS = {
    "lr": 1e-4, "lr_backbone": 1e-5, "lr_mask": 1e-4, "batch_size": 2, "weight_decay": 1e-4, "epochs": 300,
    "lr_drop": 200, "mask_epochs": 0, "clip_max_norm": 0.1, "num_classes": 91, "num_queries": 100,
    "hidden_dim": 256, "nheads": 8, "enc_layers": 6, "dec_layers": 6, "dim_feedforward": 2048, "dropout": 0.1,
    "set_cost_class": 2.0, "set_cost_bbox": 5.0, "set_cost_giou": 2.0, "cls_loss_coef": 2.0,
    "bbox_loss_coef": 5.0, "giou_loss_coef": 2.0, "device": "cuda", "output_dir": "", "seed": 42,
}


def get_args_parser():
    parser = argparse.ArgumentParser("DETR focal training", add_help=False)
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name}", default=default, type=type(default))
    parser.add_argument("--amp", action="store_true")
    return parser


def main(args):
    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    torch.manual_seed(args.seed + utils.get_rank())
    model, criterion = build_model(args)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)
    scaler = make_grad_scaler(args.amp)

    data_loader_train = utils.build_loader(build_dataset("train", args), args.batch_size, train=True)
    data_loader_val = utils.build_loader(build_dataset("val", args), args.batch_size, train=False)
    output_dir, start_time = Path(args.output_dir), time.time()
    for epoch in range(args.epochs):
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch,
                                      scaler, args.clip_max_norm, amp=args.amp)
        lr_scheduler.step()
        if args.output_dir:
            utils.save_on_master({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                                  "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict(),
                                  "epoch": epoch, "args": args}, output_dir / "checkpoint.pth")
        test_stats = evaluate(model, criterion, data_loader_val, device, amp=args.amp)
        if args.output_dir and utils.is_main_process():
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps({"epoch": epoch, "train": train_stats, "test": test_stats}) + "\n")
    if args.mask_epochs > 0:
        mask_head = train_mask_head(args, model_without_ddp, data_loader_train)
        utils.save_on_master(mask_head.state_dict(), output_dir / "mask_head.pth")
    print("Training time", str(datetime.timedelta(seconds=int(time.time() - start_time))))


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DETR training and evaluation script", parents=[get_args_parser()])
    main(parser.parse_args())
