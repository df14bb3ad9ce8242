"""Deformable-DETR style decoder head: multi-scale deformable cross-attention with
a PyTorch sampling kernel, two-stage query selection with a global context token,
sigmoid focal classification and L1/GIoU box losses.

Trained with CUDA bf16 autocast.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment


def inverse_sigmoid(x, eps=1e-5):
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def box_cxcywh_to_xyxy(b):
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def generalized_box_iou(a, b):
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.max(a[:, None, :2], b[:, :2])
    rb = torch.min(a[:, None, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a[:, None] + area_b - inter
    iou = inter / union
    lt_c = torch.min(a[:, None, :2], b[:, :2])
    rb_c = torch.max(a[:, None, 2:], b[:, 2:])
    area_c = (rb_c - lt_c).clamp(min=0).prod(-1)
    return iou - (area_c - union) / area_c


class MSDeformAttnFunction(torch.autograd.Function):
    """Reference multi-scale deformable sampling, always computed in fp32."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, value, shapes, sampling_locations, attention_weights):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        ctx.shapes = shapes
        return ms_deform_attn_core(value, shapes, sampling_locations, attention_weights)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        value, loc, w = ctx.saved_tensors
        with torch.enable_grad():
            value, loc, w = value.detach().requires_grad_(), loc.detach().requires_grad_(), w.detach().requires_grad_()
            out = ms_deform_attn_core(value, ctx.shapes, loc, w)
            gv, gl, gw = torch.autograd.grad(out, (value, loc, w), grad_out)
        return gv, None, gl, gw


def ms_deform_attn_core(value, shapes, sampling_locations, attention_weights):
    B, _, H, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    splits = value.split([h * w for h, w in shapes], dim=1)
    grids = 2 * sampling_locations - 1
    sampled = []
    for lvl, (h, w) in enumerate(shapes):
        v = splits[lvl].flatten(2).transpose(1, 2).reshape(B * H, D, h, w)
        g = grids[:, :, :, lvl].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False))
    w = attention_weights.transpose(1, 2).reshape(B * H, 1, Lq, L * P)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * w).sum(-1)
    return out.view(B, H * D, Lq).transpose(1, 2).contiguous()


class MSDeformAttn(nn.Module):
    def __init__(self, d_model=256, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.n_levels, self.n_heads, self.n_points = n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)

    def forward(self, query, reference_points, memory, shapes, memory_padding_mask):
        B, Lq, _ = query.shape
        value = self.value_proj(memory)
        value = value.masked_fill(memory_padding_mask[..., None], 0.0)
        value = value.view(B, memory.size(1), self.n_heads, -1)
        offsets = self.sampling_offsets(query).view(B, Lq, self.n_heads, self.n_levels, self.n_points, 2)
        attn = self.attention_weights(query).view(B, Lq, self.n_heads, self.n_levels * self.n_points)
        attn = F.softmax(attn, dim=-1).view(B, Lq, self.n_heads, self.n_levels, self.n_points)
        normalizer = torch.tensor([[w, h] for h, w in shapes], device=query.device, dtype=torch.float32)
        loc = reference_points[:, :, None, None, None, :] + offsets / normalizer[None, None, None, :, None, :]
        out = MSDeformAttnFunction.apply(value, shapes, loc, attn)
        return self.output_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, d_model=256, n_heads=8, d_ffn=1024, dropout=0.1):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(d_model)
        self.cross_attn = MSDeformAttn(d_model, n_heads=n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(d_ffn, d_model))
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, tgt, query_pos, ref, memory, shapes, mem_mask):
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.self_attn(q, k, tgt, need_weights=False)[0])
        tgt = self.norm2(tgt + self.cross_attn(tgt + query_pos, ref, memory, shapes, mem_mask))
        return self.norm3(tgt + self.ffn(tgt))


class TwoStageDecoder(nn.Module):
    def __init__(self, d_model=256, n_layers=6, n_queries=300, n_classes=91):
        super().__init__()
        self.n_queries = n_queries
        self.enc_score = nn.Linear(d_model, n_classes)
        self.enc_box = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, 4))
        self.token_scorer = nn.Linear(d_model, 1)
        self.ctx_proj = nn.Linear(d_model, d_model)
        self.query_embed = nn.Linear(4, d_model)
        self.layers = nn.ModuleList([DecoderLayer(d_model) for _ in range(n_layers)])
        self.class_embed = nn.ModuleList([nn.Linear(d_model, n_classes) for _ in range(n_layers)])
        self.bbox_embed = nn.ModuleList([
            nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, 4)) for _ in range(n_layers)
        ])

    def forward(self, memory, mem_mask, shapes, proposals):
        # proposals: (B, S, 4) anchor boxes built in fp32 from the feature map grid
        scores = self.token_scorer(memory).squeeze(-1)
        scores = scores - scores.mean(dim=1, keepdim=True)  # expect: AMP004
        keep = scores.masked_fill(mem_mask, float("-inf"))
        context = self.ctx_proj(memory).mean(dim=1, keepdim=True)  # expect: AMP004
        cls_enc = self.enc_score(memory).max(-1).values.masked_fill(mem_mask, float("-inf")) + keep.detach()
        topk = cls_enc.topk(self.n_queries, dim=1).indices
        props = torch.gather(proposals, 1, topk[..., None].expand(-1, -1, 4))
        boxes = (self.enc_box(memory).gather(1, topk[..., None].expand(-1, -1, 4)) + inverse_sigmoid(props)).sigmoid()
        ref = boxes.detach()
        tgt = torch.zeros_like(self.query_embed(ref)) + context
        outputs = []
        for layer, cls_head, box_head in zip(self.layers, self.class_embed, self.bbox_embed):
            query_pos = self.query_embed(ref)
            tgt = layer(tgt, query_pos, ref[..., :2], memory, shapes, mem_mask)
            logits = cls_head(tgt)
            boxes = (box_head(tgt) + inverse_sigmoid(ref)).sigmoid()
            outputs.append({"logits": logits, "boxes": boxes, "hidden": tgt})
            ref = boxes.detach()
        return outputs


def sigmoid_focal_loss(logits, targets, num_boxes, alpha=0.25, gamma=2.0):
    prob = logits.sigmoid()
    ce = F.binary_cross_entropy(prob, targets, reduction="none")  # expect: AMP003
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.mean(1).sum() / num_boxes


class SetCriterion(nn.Module):
    def __init__(self, n_classes, w_cls=2.0, w_l1=5.0, w_giou=2.0, w_div=0.1):
        super().__init__()
        self.n_classes = n_classes
        self.w_cls, self.w_l1, self.w_giou, self.w_div = w_cls, w_l1, w_giou, w_div
        self.div_proj = nn.Linear(256, 128)

    def query_diversity(self, hidden):
        z = F.normalize(self.div_proj(hidden), dim=-1)
        sim = z @ z.transpose(1, 2)
        off = sim - torch.diag_embed(torch.diagonal(sim, dim1=1, dim2=2))
        return off.abs().mean()  # expect: AMP004

    def forward(self, outputs, targets, indices):
        num_boxes = max(sum(len(t["labels"]) for t in targets), 1)
        losses = {}
        for i, out in enumerate(outputs):
            b_idx = torch.cat([torch.full_like(src, k) for k, (src, _) in enumerate(indices)])
            s_idx = torch.cat([src for src, _ in indices])
            tgt_cls = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)])
            onehot = torch.zeros_like(out["logits"], dtype=torch.float32)
            onehot[b_idx, s_idx, tgt_cls] = 1.0
            l_cls = sigmoid_focal_loss(out["logits"], onehot, num_boxes)
            src_boxes = out["boxes"][b_idx, s_idx]
            tgt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)])
            l_l1 = F.l1_loss(src_boxes, tgt_boxes, reduction="none").sum() / num_boxes
            giou = generalized_box_iou(box_cxcywh_to_xyxy(src_boxes.float()), box_cxcywh_to_xyxy(tgt_boxes))
            l_giou = (1 - torch.diag(giou)).sum() / num_boxes
            losses[f"loss_{i}"] = self.w_cls * l_cls + self.w_l1 * l_l1 + self.w_giou * l_giou
        losses["loss_div"] = self.w_div * self.query_diversity(outputs[-1]["hidden"])
        return losses


@torch.no_grad()
def hungarian_matcher(out, targets, w_cls=2.0, w_l1=5.0):
    indices = []
    for b, t in enumerate(targets):
        prob = out["logits"][b].float().sigmoid()[:, t["labels"]]
        cost = w_l1 * torch.cdist(out["boxes"][b].float(), t["boxes"].float(), p=1) - w_cls * prob
        c = cost.cpu().numpy()
        c[~np.isfinite(c)] = 1e9
        i, j = linear_sum_assignment(c)
        indices.append((torch.as_tensor(i, dtype=torch.long), torch.as_tensor(j, dtype=torch.long)))
    return indices


def train_one_epoch(model, criterion, matcher, loader, optimizer, device="cuda", max_norm=0.1):
    model.train()
    criterion.train()
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    for samples, targets in loader:
        memory, mem_mask, shapes, proposals = [t.to(device) if torch.is_tensor(t) else t for t in samples]
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(memory, mem_mask, shapes, proposals)
            with torch.no_grad():
                indices = matcher(outputs[-1], targets)
            loss_dict = criterion(outputs, targets, indices)
            loss = sum(loss_dict.values())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
    return {k: v.item() for k, v in loss_dict.items()}


def main(loader, epochs=50, lr=2e-4, device="cuda"):
    model = TwoStageDecoder().to(device)
    criterion = SetCriterion(n_classes=91).to(device)
    params = list(model.parameters()) + list(criterion.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    lr_sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40)
    for epoch in range(epochs):
        stats = train_one_epoch(model, criterion, hungarian_matcher, loader, optimizer, device=device)
        lr_sched.step()
        print(epoch, stats)
    return model
