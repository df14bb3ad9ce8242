"""Mask2Former-style segmentation: pixel decoder, masked-attention decoder, set criterion."""
import math

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn


class LayerNorm2d(nn.Module):
    """Channel-first LayerNorm, as in the ConvNeXt / detectron2 necks."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=128, temperature=10000):
        super().__init__()
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.scale = 2 * math.pi

    def forward(self, x):
        not_mask = torch.ones(x.shape[0], x.shape[2], x.shape[3], device=x.device, dtype=torch.bool)
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        y_embed = y_embed / (y_embed[:, -1:, :] + 1e-6) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + 1e-6) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=x.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class SimpleBackbone(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512)):
        super().__init__()
        stages, c_in = [], 3
        for w in widths:
            stages.append(nn.Sequential(nn.Conv2d(c_in, w, 3, stride=2, padding=1, bias=False),
                                        nn.BatchNorm2d(w), nn.ReLU(inplace=True)))
            c_in = w
        self.stages = nn.ModuleList(stages)

    def forward(self, x):
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        return feats


class PixelDecoder(nn.Module):
    def __init__(self, in_channels=(64, 128, 256, 512), conv_dim=256, mask_dim=256):
        super().__init__()
        self.input_proj = nn.Sequential(nn.Conv2d(in_channels[-1], conv_dim, 1), LayerNorm2d(conv_dim))
        self.lateral_convs = nn.ModuleList([nn.Sequential(nn.Conv2d(c, conv_dim, 1, bias=False),
                                                          LayerNorm2d(conv_dim)) for c in in_channels[:-1]])
        self.output_convs = nn.ModuleList([
            nn.Sequential(nn.Conv2d(conv_dim, conv_dim, 3, padding=1, bias=False),
                          LayerNorm2d(conv_dim), nn.ReLU(inplace=True))
            for _ in in_channels[:-1]])
        self.mask_features = nn.Conv2d(conv_dim, mask_dim, 3, padding=1)
        self.context_fc = nn.Conv2d(mask_dim, mask_dim, 1)

    def forward(self, features):
        y = self.input_proj(features[-1])
        multi_scale = [y]
        for idx in range(len(features) - 2, -1, -1):
            lateral = self.lateral_convs[idx](features[idx])
            y = lateral + F.interpolate(y, size=lateral.shape[-2:], mode="nearest")
            y = self.output_convs[idx](y)
            multi_scale.append(y)
        mask_feats = self.mask_features(y)
        context = mask_feats.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        mask_feats = mask_feats * torch.sigmoid(self.context_fc(context))
        return mask_feats, multi_scale[:3]


class MaskedCrossAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, query, memory, pos, attn_mask, memory_pad):
        b, q_len, c = query.shape
        q = self.q_proj(query).view(b, q_len, self.heads, -1).transpose(1, 2)
        k = self.k_proj(memory + pos).view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        v = self.v_proj(memory).view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(attn_mask[:, None], torch.finfo(scores.dtype).min)
        scores = scores.masked_fill(memory_pad[:, None, None, :], -1e9)  # expect: AMP007
        attn = scores.softmax(dim=-1)
        out = torch.matmul(attn.to(v.dtype), v).transpose(1, 2).reshape(b, q_len, c)
        return self.out_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim=1024):
        super().__init__()
        self.cross_attn = MaskedCrossAttention(dim, heads)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.ReLU(inplace=True), nn.Linear(ffn_dim, dim))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, query, query_pos, memory, pos, attn_mask, memory_pad):
        query = self.norm1(query + self.cross_attn(query + query_pos, memory, pos, attn_mask, memory_pad))
        qk = query + query_pos
        query = self.norm2(query + self.self_attn(qk, qk, query, need_weights=False)[0])
        return self.norm3(query + self.ffn(query))


class MaskedAttentionDecoder(nn.Module):
    def __init__(self, num_classes, dim=256, heads=8, num_layers=6, num_queries=100, mask_dim=256):
        super().__init__()
        self.num_queries = num_queries
        self.pe_layer = PositionEmbeddingSine(dim // 2)
        self.query_feat = nn.Embedding(num_queries, dim)
        self.query_embed = nn.Embedding(num_queries, dim)
        self.level_embed = nn.Embedding(3, dim)
        self.layers = nn.ModuleList([DecoderLayer(dim, heads) for _ in range(num_layers)])
        self.decoder_norm = nn.LayerNorm(dim)
        self.class_embed = nn.Linear(dim, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True),
                                        nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, mask_dim))

    def prediction_heads(self, output, mask_features, target_size):
        decoder_output = self.decoder_norm(output)
        outputs_class = self.class_embed(decoder_output)
        mask_embed = self.mask_embed(decoder_output)
        outputs_mask = torch.einsum("bqc,bchw->bqhw", mask_embed, mask_features)
        attn_mask = F.interpolate(outputs_mask, size=target_size, mode="bilinear", align_corners=False)
        attn_mask = (attn_mask.sigmoid().flatten(2) < 0.5).detach()
        full = attn_mask.sum(-1) == attn_mask.shape[-1]
        attn_mask[full] = False
        return outputs_class, outputs_mask, attn_mask

    def forward(self, multi_scale, mask_features, pad_masks):
        memories, positions, sizes, pads = [], [], [], []
        for lvl, feat in enumerate(multi_scale):
            sizes.append(feat.shape[-2:])
            positions.append(self.pe_layer(feat).flatten(2).transpose(1, 2))
            memories.append(feat.flatten(2).transpose(1, 2) + self.level_embed.weight[lvl])
            pads.append(F.interpolate(pad_masks[:, None].float(), size=feat.shape[-2:]).flatten(1) > 0.5)
        b = mask_features.shape[0]
        query = self.query_feat.weight.unsqueeze(0).expand(b, -1, -1)
        query_pos = self.query_embed.weight.unsqueeze(0).expand(b, -1, -1)
        outputs_class, outputs_mask, attn_mask = self.prediction_heads(query, mask_features, sizes[0])
        for i, layer in enumerate(self.layers):
            lvl = i % len(memories)
            query = layer(query, query_pos, memories[lvl], positions[lvl], attn_mask, pads[lvl])
            next_size = sizes[(i + 1) % len(memories)]
            outputs_class, outputs_mask, attn_mask = self.prediction_heads(query, mask_features, next_size)
        return outputs_class, outputs_mask


class Mask2FormerLite(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = SimpleBackbone()
        self.pixel_decoder = PixelDecoder()
        self.decoder = MaskedAttentionDecoder(num_classes)

    def forward(self, images, pad_masks):
        features = self.backbone(images)
        mask_features, multi_scale = self.pixel_decoder(features)
        return self.decoder(multi_scale, mask_features, pad_masks)


def dice_loss(inputs, targets, num_masks):
    inputs = inputs.sigmoid().flatten(1)
    numerator = 2 * (inputs * targets).sum(-1)
    denominator = inputs.sum(-1) + targets.sum(-1)
    loss = 1 - (numerator + 1) / (denominator + 1)
    return loss.sum() / num_masks


def sigmoid_focal_loss(inputs, targets, num_masks, alpha=0.25, gamma=2.0):
    prob = inputs.sigmoid()
    log_p = torch.log(prob + 1e-8)  # expect: AMP011
    log_1mp = torch.log(1.0 - prob + 1e-8)  # expect: AMP011
    ce = -(targets * log_p + (1.0 - targets) * log_1mp)
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).mean(1).sum() / num_masks


class SetCriterion(nn.Module):
    def __init__(self, num_classes, eos_coef=0.1, weight_dict=None):
        super().__init__()
        self.num_classes = num_classes
        self.weight_dict = weight_dict or {"loss_ce": 2.0, "loss_mask": 5.0, "loss_dice": 5.0}
        self.register_buffer("empty_weight", torch.cat([torch.ones(num_classes), torch.tensor([eos_coef])]))

    @torch.no_grad()
    def match(self, pred_logits, pred_masks, targets):
        indices = []
        for b, tgt in enumerate(targets):
            out_prob = pred_logits[b].float().softmax(-1)
            out_mask = pred_masks[b].float().flatten(1)
            tgt_mask = F.interpolate(tgt["masks"][:, None].float(), size=pred_masks.shape[-2:]).flatten(1)
            cost_class = -out_prob[:, tgt["labels"]]
            numerator = 2 * out_mask.sigmoid() @ tgt_mask.t()
            denominator = out_mask.sigmoid().sum(-1)[:, None] + tgt_mask.sum(-1)[None, :]
            cost_dice = 1 - (numerator + 1) / (denominator + 1)
            cost = (2.0 * cost_class + 5.0 * cost_dice).cpu()
            cost[~torch.isfinite(cost)] = 1e8
            row, col = linear_sum_assignment(cost.numpy())
            indices.append((torch.as_tensor(row, dtype=torch.long), torch.as_tensor(col, dtype=torch.long)))
        return indices

    def forward(self, pred_logits, pred_masks, targets):
        indices = self.match(pred_logits, pred_masks, targets)
        num_masks = max(sum(len(t["labels"]) for t in targets), 1)
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])
        target_classes = torch.full(pred_logits.shape[:2], self.num_classes, dtype=torch.long,
                                    device=pred_logits.device)
        target_classes[batch_idx, src_idx] = torch.cat(
            [t["labels"][j] for t, (_, j) in zip(targets, indices)]).to(pred_logits.device)
        loss_ce = F.cross_entropy(pred_logits.transpose(1, 2), target_classes, self.empty_weight)
        src_masks = pred_masks[batch_idx, src_idx]
        tgt_masks = torch.cat([t["masks"][j] for t, (_, j) in zip(targets, indices)]).float()
        tgt_masks = F.interpolate(tgt_masks[:, None], size=src_masks.shape[-2:], mode="nearest")[:, 0]
        return {
            "loss_ce": loss_ce,
            "loss_mask": sigmoid_focal_loss(src_masks.flatten(1), tgt_masks.flatten(1), num_masks),
            "loss_dice": dice_loss(src_masks, tgt_masks.flatten(1), num_masks),
        }


def train_one_epoch(model, criterion, loader, optimizer, scaler, device, max_norm=0.01):
    model.train()
    for images, pad_masks, targets in loader:
        images, pad_masks = images.to(device, non_blocking=True), pad_masks.to(device, non_blocking=True)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.float16):
            pred_logits, pred_masks = model(images, pad_masks)
            loss_dict = criterion(pred_logits, pred_masks, targets)
            loss = sum(loss_dict[k] * criterion.weight_dict[k] for k in loss_dict)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()


def main(loader, num_classes=133, epochs=50, device="cuda"):
    model = Mask2FormerLite(num_classes).to(device)
    criterion = SetCriterion(num_classes).to(device)
    backbone_params = [p for n, p in model.named_parameters() if n.startswith("backbone.")]
    other_params = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.AdamW([{"params": backbone_params, "lr": 1e-5},
                                   {"params": other_params}], lr=1e-4, weight_decay=0.05)
    try:
        scaler = torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler()
    for _ in range(epochs):
        train_one_epoch(model, criterion, loader, optimizer, scaler, device)
