"""Deformable-DETR style detection head in pure PyTorch (no custom CUDA op).

Multi-scale deformable attention is computed with grid_sample; the neck maps backbone
levels to d_model with optional squeeze-excite and adds a global context token.
"""
import argparse
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from models.backbone import build_backbone
from models.matcher import HungarianMatcher
from util.box_ops import box_cxcywh_to_xyxy, generalized_box_iou
from datasets.coco import build_coco_loaders

logger = logging.getLogger(__name__)


def inverse_sigmoid(x, eps=1e-5):
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def ms_deform_attn_core_pytorch(value, spatial_shapes, sampling_locations, attention_weights):
    bs, _, n_heads, d_head = value.shape
    _, len_q, _, n_levels, n_points, _ = sampling_locations.shape
    value_list = value.split([int(h) * int(w) for h, w in spatial_shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampled = []
    for lid, (h, w) in enumerate(spatial_shapes):
        value_l = value_list[lid].flatten(2).transpose(1, 2).reshape(bs * n_heads, d_head, int(h), int(w))
        grid_l = sampling_grids[:, :, :, lid].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(value_l, grid_l.to(value_l.dtype), mode="bilinear",
                                     padding_mode="zeros", align_corners=False))
    attention_weights = attention_weights.transpose(1, 2).reshape(bs * n_heads, 1, len_q, n_levels * n_points)
    output = (torch.stack(sampled, dim=-2).flatten(-2) * attention_weights).sum(-1)
    return output.view(bs, n_heads * d_head, len_q).transpose(1, 2).contiguous()


class MSDeformAttn(nn.Module):
    def __init__(self, d_model=256, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.n_levels, self.n_heads, self.n_points = n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)

    def forward(self, query, reference_points, input_flatten, spatial_shapes, padding_mask=None):
        n, len_q, _ = query.shape
        value = self.value_proj(input_flatten)
        if padding_mask is not None:
            value = value.masked_fill(padding_mask[..., None], float(0))
        value = value.view(n, -1, self.n_heads, value.shape[-1] // self.n_heads)
        offsets = self.sampling_offsets(query).view(n, len_q, self.n_heads, self.n_levels, self.n_points, 2)
        attn = self.attention_weights(query).view(n, len_q, self.n_heads, self.n_levels * self.n_points)
        attn = F.softmax(attn, -1).view(n, len_q, self.n_heads, self.n_levels, self.n_points)
        normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        loc = reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
        out = ms_deform_attn_core_pytorch(value, spatial_shapes, loc, attn)
        return self.output_proj(out)


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.fc2(F.relu(self.fc1(s)))
        return x * torch.sigmoid(s)


class ChannelMapper(nn.Module):
    def __init__(self, in_channels, d_model=256, use_se=True):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(c, d_model, 1) for c in in_channels])
        self.se = nn.ModuleList([SqueezeExcite(d_model) if use_se else nn.Identity() for _ in in_channels])
        self.norms = nn.ModuleList([nn.GroupNorm(32, d_model) for _ in in_channels])
        self.ctx_proj = nn.Linear(d_model * len(in_channels), d_model)

    def forward(self, feats):
        lateral = [conv(f) for conv, f in zip(self.convs, feats)]
        outs = [norm(se(x)) for norm, se, x in zip(self.norms, self.se, lateral)]
        level_ctx = torch.stack([x.mean(dim=(2, 3)) for x in lateral], dim=1)  # expect: AMP004
        return outs, self.ctx_proj(level_ctx.flatten(1))


class EncoderLayer(nn.Module):
    def __init__(self, d_model=256, d_ffn=1024, dropout=0.1):
        super().__init__()
        self.self_attn = MSDeformAttn(d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ffn, d_model))
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, src, pos, reference_points, spatial_shapes, padding_mask):
        src = self.norm1(src + self.self_attn(src + pos, reference_points, src, spatial_shapes, padding_mask))
        return self.norm2(src + self.ffn(src))


class DecoderLayer(nn.Module):
    def __init__(self, d_model=256, n_heads=8, d_ffn=1024):
        super().__init__()
        self.n_heads = n_heads
        self.scale = (d_model // n_heads) ** -0.5
        self.qk = nn.Linear(d_model, 2 * d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.cross_attn = MSDeformAttn(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Linear(d_ffn, d_model))
        self.norm3 = nn.LayerNorm(d_model)

    def _self_attn(self, tgt, pos, attn_mask=None):
        b, n, c = tgt.shape
        q, k = self.qk(tgt + pos).view(b, n, 2, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        v = self.v(tgt).view(b, n, self.n_heads, -1).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if attn_mask is not None:
            attn = attn.masked_fill(attn_mask, -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))

    def forward(self, tgt, pos, reference_points, memory, spatial_shapes, padding_mask, attn_mask=None):
        tgt = self.norm1(tgt + self._self_attn(tgt, pos, attn_mask))
        tgt = self.norm2(tgt + self.cross_attn(tgt + pos, reference_points, memory, spatial_shapes, padding_mask))
        return self.norm3(tgt + self.ffn(tgt))


class MLP(nn.Module):
    def __init__(self, in_dim, hidden, out_dim, num_layers):
        super().__init__()
        dims = [in_dim] + [hidden] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:] + [out_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < len(self.layers) - 1 else layer(x)
        return x


class DeformableDetrHead(nn.Module):
    def __init__(self, backbone, num_classes=91, d_model=256, num_queries=300, enc_layers=6, dec_layers=6):
        super().__init__()
        self.backbone = backbone
        self.neck = ChannelMapper(backbone.num_channels, d_model)
        self.level_embed = nn.Parameter(torch.randn(len(backbone.num_channels), d_model))
        self.encoder = nn.ModuleList([EncoderLayer(d_model) for _ in range(enc_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model) for _ in range(dec_layers)])
        self.query_embed = nn.Embedding(num_queries, 2 * d_model)
        self.reference_points = nn.Linear(d_model, 2)
        self.class_embed = nn.Linear(d_model, num_classes)
        self.bbox_embed = MLP(d_model, d_model, 4, 3)
        prior = 0.01
        nn.init.constant_(self.class_embed.bias, -math.log((1 - prior) / prior))

    @staticmethod
    def get_valid_ratio(mask):
        _, h, w = mask.shape
        valid_h = torch.sum(~mask[:, :, 0], 1)
        valid_w = torch.sum(~mask[:, 0, :], 1)
        return torch.stack([valid_w.float() / w, valid_h.float() / h], -1)

    def forward(self, images, masks, pos_embeds):
        srcs, global_ctx = self.neck(self.backbone(images))
        spatial_shapes = torch.as_tensor([s.shape[-2:] for s in srcs], device=images.device)
        src_flat = torch.cat([s.flatten(2).transpose(1, 2) for s in srcs], 1)
        mask_flat = torch.cat([F.interpolate(masks[None].float(), size=s.shape[-2:])[0].bool().flatten(1) for s in srcs], 1)
        pos_flat = torch.cat([p.flatten(2).transpose(1, 2) + self.level_embed[i] for i, p in enumerate(pos_embeds)], 1)
        ref_enc = torch.rand(src_flat.shape[0], src_flat.shape[1], len(srcs), 2, device=images.device)
        memory = src_flat
        for layer in self.encoder:
            memory = layer(memory, pos_flat, ref_enc, spatial_shapes, mask_flat)
        query_pos, tgt = self.query_embed.weight.unsqueeze(0).expand(memory.shape[0], -1, -1).chunk(2, dim=-1)
        tgt = tgt + global_ctx.unsqueeze(1)
        reference = self.reference_points(query_pos).sigmoid()
        outputs_class, outputs_coord = [], []
        for layer in self.decoder:
            tgt = layer(tgt, query_pos, reference[:, :, None].expand(-1, -1, len(srcs), -1), memory, spatial_shapes, mask_flat)
            outputs_class.append(self.class_embed(tgt))
            outputs_coord.append((self.bbox_embed(tgt) + inverse_sigmoid(reference)).sigmoid())
        out = {"pred_logits": outputs_class[-1], "pred_boxes": outputs_coord[-1]}
        out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(outputs_class[:-1], outputs_coord[:-1])]
        return out


def sigmoid_focal_loss(inputs, targets, num_boxes, alpha=0.25, gamma=2.0):
    prob = inputs.sigmoid()
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.mean(1).sum() / num_boxes


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict):
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict = num_classes, matcher, weight_dict

    def _single(self, outputs, targets, num_boxes):
        indices = self.matcher(outputs, targets)
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])
        logits = outputs["pred_logits"]
        onehot = torch.zeros_like(logits, dtype=torch.float32)
        for i, (src, tgt) in enumerate(indices):
            onehot[i, src, targets[i]["labels"][tgt]] = 1.0
        src_boxes = outputs["pred_boxes"][batch_idx, src_idx]
        tgt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)])
        l1 = F.l1_loss(src_boxes, tgt_boxes, reduction="none").sum() / num_boxes
        giou = 1 - torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes.float()), box_cxcywh_to_xyxy(tgt_boxes)))
        return {"loss_ce": sigmoid_focal_loss(logits, onehot, num_boxes), "loss_bbox": l1, "loss_giou": giou.sum() / num_boxes}

    def forward(self, outputs, targets):
        num_boxes = max(sum(len(t["labels"]) for t in targets), 1)
        losses = self._single(outputs, targets, num_boxes)
        for i, aux in enumerate(outputs["aux_outputs"]):
            losses.update({f"{k}_{i}": v for k, v in self._single(aux, targets, num_boxes).items()})
        return losses


class AmpStepper:
    def __init__(self, optimizer, params, max_norm=0.1, enabled=True):
        self.optimizer, self.params, self.max_norm = optimizer, list(params), max_norm
        self.scaler = torch.amp.GradScaler("cuda", enabled=enabled)

    def backward_and_step(self, loss):
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        grad_norm = None
        if self.max_norm > 0:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.scaler.step(self.optimizer)  # expect: AMP006
        return grad_norm

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}


def train_one_epoch(model, criterion, loader, stepper, epoch, amp=True, print_freq=50):
    model.train()
    criterion.train()
    for it, (images, masks, pos_embeds, targets) in enumerate(loader):
        images, masks = images.cuda(non_blocking=True), masks.cuda(non_blocking=True)
        pos_embeds = [p.cuda(non_blocking=True) for p in pos_embeds]
        targets = [{k: v.cuda(non_blocking=True) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            outputs = model(images, masks, pos_embeds)
            loss_dict = criterion(outputs, targets)
            weights = criterion.weight_dict
            losses = sum(loss_dict[k] * weights[k.rsplit("_", 1)[0] if k[-1].isdigit() else k] for k in loss_dict)
        grad_norm = stepper.backward_and_step(losses)
        if it % print_freq == 0:
            logger.info("epoch %d it %d loss %.4f grad_norm %s", epoch, it, losses.item(),
                        f"{grad_norm.item():.3f}" if grad_norm is not None else "-")


def main():
    parser = argparse.ArgumentParser("deformable detr head")
    parser.add_argument("--coco-path", required=True)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--clip-max-norm", type=float, default=0.1)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--output-dir", default="out/ddetr")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    backbone = build_backbone("resnet50", return_interm_layers=True)
    model = DeformableDetrHead(backbone).cuda()
    weight_dict = {"loss_ce": 2.0, "loss_bbox": 5.0, "loss_giou": 2.0}
    criterion = SetCriterion(91, HungarianMatcher(2.0, 5.0, 2.0), weight_dict)
    param_dicts = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad], "lr": args.lr * 0.1},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=1e-4)
    stepper = AmpStepper(optimizer, model.parameters(), args.clip_max_norm, enabled=args.amp)
    train_loader, _ = build_coco_loaders(args.coco_path)
    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, stepper, epoch, amp=args.amp)
        torch.save({"model": model.state_dict(), **stepper.state_dict(), "epoch": epoch},
                   os.path.join(args.output_dir, "checkpoint.pth"))


if __name__ == "__main__":
    main()
