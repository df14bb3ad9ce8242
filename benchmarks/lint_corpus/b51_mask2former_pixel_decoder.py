"""Mask2Former-style segmenter: FPN pixel decoder with an efficient (linear) attention encoder,
masked-attention transformer decoder, Hungarian set criterion.

    python b51_mask2former_pixel_decoder.py --amp --iters 160000
"""
import argparse
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment


class LayerNorm2d(nn.Module):
    """detectron2's channels-first LayerNorm."""

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
        self.num_pos_feats, self.temperature, self.scale = num_pos_feats, temperature, 2 * math.pi

    def forward(self, x):
        not_mask = torch.ones(x.shape[0], *x.shape[-2:], dtype=torch.bool, device=x.device)
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        y_embed = y_embed / (y_embed[:, -1:, :] + 1e-6) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + 1e-6) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=x.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x, pos_y = x_embed[..., None] / dim_t, y_embed[..., None] / dim_t
        pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class LinearAttentionLayer(nn.Module):
    """Efficient-attention encoder layer (elu+1 feature map) over the 1/32 pixel features."""

    def __init__(self, dim, heads=8, ffn=1024):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.ReLU(inplace=True), nn.Linear(ffn, dim))

    def forward(self, src, pos):
        b, n, c = src.shape
        split = lambda t: t.view(b, n, self.heads, c // self.heads).transpose(1, 2)
        q = F.elu(split(self.q(src + pos))) + 1.0
        k = F.elu(split(self.k(src + pos))) + 1.0
        v = split(self.v(src))
        kv = torch.matmul(k.transpose(-2, -1), v)
        k_sum = k.sum(dim=-2)
        z = 1.0 / (torch.matmul(q, k_sum.unsqueeze(-1)).squeeze(-1) + 1e-8)  # expect: AMP011
        out = (torch.matmul(q, kv) * z.unsqueeze(-1)).transpose(1, 2).reshape(b, n, c)
        src = self.norm1(src + self.proj(out))
        return self.norm2(src + self.ffn(src))


class PixelDecoder(nn.Module):
    def __init__(self, in_channels=(256, 512, 1024, 2048), conv_dim=256, mask_dim=256, n_enc=4):
        super().__init__()
        self.pe = PositionEmbeddingSine(conv_dim // 2)
        self.input_proj = nn.Sequential(nn.Conv2d(in_channels[3], conv_dim, 1), LayerNorm2d(conv_dim))
        self.encoder = nn.ModuleList([LinearAttentionLayer(conv_dim) for _ in range(n_enc)])
        self.top_down = nn.ModuleDict({
            name: nn.Sequential(nn.Conv2d(c, conv_dim, 1), LayerNorm2d(conv_dim))
            for name, c in zip(("res4", "res3", "res2"), (in_channels[2], in_channels[1], in_channels[0]))
        })
        self.out_conv = nn.Sequential(nn.Conv2d(conv_dim, conv_dim, 3, padding=1), nn.ReLU(inplace=True))
        self.mask_features = nn.Conv2d(conv_dim, mask_dim, 1)

    def forward(self, feats):
        x = self.input_proj(feats["res5"])
        b, c, h, w = x.shape
        pos = self.pe(x).flatten(2).transpose(1, 2)
        src = x.flatten(2).transpose(1, 2)
        for layer in self.encoder:
            src = layer(src, pos)
        y = src.transpose(1, 2).reshape(b, c, h, w)
        multi_scale = [y]
        for name, lateral in self.top_down.items():
            lat = lateral(feats[name])
            y = self.out_conv(lat + F.interpolate(y, size=lat.shape[-2:], mode="bilinear", align_corners=False))
            multi_scale.append(y)
        return self.mask_features(y), multi_scale[:3]


class MaskedCrossAttention(nn.Module):
    def __init__(self, dim, heads=8):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tgt, memory, attn_mask, pos, query_pos):
        b, nq, c = tgt.shape
        h = self.heads
        q = self.q(tgt + query_pos).view(b, nq, h, -1).transpose(1, 2)
        k = self.k(memory + pos).view(b, -1, h, c // h).transpose(1, 2)
        v = self.v(memory).view(b, -1, h, c // h).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(attn_mask.view(b, h, nq, -1), -1e9)  # expect: AMP007
        out = torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, nq, c)
        return self.norm(tgt + self.o(out))


class MaskedTransformerDecoder(nn.Module):
    def __init__(self, num_classes, dim=256, num_queries=100, heads=8, n_layers=9):
        super().__init__()
        self.heads, self.n_levels = heads, 3
        self.query_feat, self.query_embed = nn.Embedding(num_queries, dim), nn.Embedding(num_queries, dim)
        self.level_embed = nn.Embedding(self.n_levels, dim)
        self.pe = PositionEmbeddingSine(dim // 2)
        self.cross = nn.ModuleList([MaskedCrossAttention(dim, heads) for _ in range(n_layers)])
        self.self_attn = nn.ModuleList([nn.MultiheadAttention(dim, heads, batch_first=True)
                                        for _ in range(n_layers)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2048), nn.ReLU(), nn.Linear(2048, dim))
                                  for _ in range(n_layers)])
        self.decoder_norm = nn.LayerNorm(dim)
        self.class_embed = nn.Linear(dim, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(),
                                        nn.Linear(dim, dim))

    def prediction_heads(self, output, mask_features, target_size):
        out = self.decoder_norm(output)
        outputs_class = self.class_embed(out)
        outputs_mask = torch.einsum("bqc,bchw->bqhw", self.mask_embed(out), mask_features)
        mask_prob = outputs_mask.sigmoid()
        fg = mask_prob > 0.5
        mask_score = (mask_prob * fg).flatten(2).mean(-1) / (fg.flatten(2).float().mean(-1) + 1e-8)  # expect: AMP004
        attn_mask = F.interpolate(outputs_mask, size=target_size, mode="bilinear", align_corners=False)
        attn_mask = (attn_mask.sigmoid().flatten(2).unsqueeze(1).repeat(1, self.heads, 1, 1) < 0.5).detach()
        attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False
        return outputs_class, outputs_mask, mask_score, attn_mask

    def forward(self, multi_scale, mask_features):
        b = mask_features.shape[0]
        srcs, poss, sizes = [], [], []
        for i, f in enumerate(multi_scale):
            sizes.append(f.shape[-2:])
            poss.append(self.pe(f).flatten(2).transpose(1, 2))
            srcs.append(f.flatten(2).transpose(1, 2) + self.level_embed.weight[i])
        output = self.query_feat.weight.unsqueeze(0).repeat(b, 1, 1)
        query_pos = self.query_embed.weight.unsqueeze(0).repeat(b, 1, 1)
        cls_, mask_, score_, attn_mask = self.prediction_heads(output, mask_features, sizes[0])
        aux = []
        for i, (cross, sa, ffn) in enumerate(zip(self.cross, self.self_attn, self.ffn)):
            lvl = i % self.n_levels
            output = cross(output, srcs[lvl], attn_mask, poss[lvl], query_pos)
            output = output + sa(output + query_pos, output + query_pos, output)[0]
            output = output + ffn(output)
            aux.append({"pred_logits": cls_, "pred_masks": mask_, "mask_score": score_})
            cls_, mask_, score_, attn_mask = self.prediction_heads(
                output, mask_features, sizes[(i + 1) % self.n_levels])
        return {"pred_logits": cls_, "pred_masks": mask_, "mask_score": score_, "aux_outputs": aux}


class Mask2Former(nn.Module):
    def __init__(self, num_classes=150):
        super().__init__()
        chans = (256, 512, 1024, 2048)
        self.stages = nn.ModuleList()
        cin = 3
        for i, c in enumerate(chans):
            self.stages.append(nn.Sequential(nn.Conv2d(cin, c, 3, 4 if i == 0 else 2, 1), nn.ReLU(inplace=True)))
            cin = c
        self.pixel_decoder = PixelDecoder(chans)
        self.predictor = MaskedTransformerDecoder(num_classes)

    def forward(self, images):
        feats, x = {}, images
        for name, stage in zip(("res2", "res3", "res4", "res5"), self.stages):
            x = stage(x)
            feats[name] = x
        mask_features, multi_scale = self.pixel_decoder(feats)
        return self.predictor(multi_scale, mask_features)


def dice_loss(inputs, targets, num_masks):
    inputs = inputs.sigmoid().flatten(1)
    numerator = 2 * (inputs * targets).sum(-1)
    denominator = inputs.sum(-1) + targets.sum(-1)
    return (1 - (numerator + 1) / (denominator + 1)).sum() / num_masks


def sigmoid_ce_loss(inputs, targets, num_masks):
    loss = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    return loss.mean(1).sum() / num_masks


class SetCriterion(nn.Module):
    def __init__(self, num_classes, eos_coef=0.1):
        super().__init__()
        self.num_classes = num_classes
        self.weight_dict = {"loss_ce": 2.0, "loss_mask": 5.0, "loss_dice": 5.0}
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    @torch.no_grad()
    def match(self, outputs, targets):
        indices = []
        for b, t in enumerate(targets):
            prob = outputs["pred_logits"][b].float().softmax(-1)
            out_mask = outputs["pred_masks"][b].float().flatten(1).sigmoid()
            tgt_mask = F.interpolate(t["masks"][None].float(), size=outputs["pred_masks"].shape[-2:])[0].flatten(1)
            dice = 1 - (2 * out_mask @ tgt_mask.T + 1) / (out_mask.sum(-1)[:, None] + tgt_mask.sum(-1)[None] + 1)
            cost = -prob[:, t["labels"]] + dice
            indices.append(linear_sum_assignment(cost.cpu().numpy()))
        return indices

    def forward(self, outputs, targets):
        indices = self.match(outputs, targets)
        num_masks = max(sum(len(t["labels"]) for t in targets), 1)
        logits = outputs["pred_logits"]
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.long, device=logits.device)
        src_masks, tgt_masks = [], []
        for b, (src, tgt) in enumerate(indices):
            target_classes[b, src] = targets[b]["labels"][tgt]
            src_masks.append(outputs["pred_masks"][b, src])
            tgt_masks.append(targets[b]["masks"][tgt])
        src_masks = torch.cat(src_masks).flatten(1)
        tgt_masks = F.interpolate(torch.cat(tgt_masks)[:, None].float(), size=outputs["pred_masks"].shape[-2:])
        tgt_masks = tgt_masks.flatten(1)
        return {"loss_ce": F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight),
                "loss_mask": sigmoid_ce_loss(src_masks, tgt_masks, num_masks),
                "loss_dice": dice_loss(src_masks, tgt_masks, num_masks)}


def train(args, loader):
    device = torch.device("cuda")
    model = Mask2Former(args.num_classes).to(device)
    criterion = SetCriterion(args.num_classes).to(device)
    backbone = [p for n, p in model.named_parameters() if n.startswith("stages")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("stages")]
    optimizer = torch.optim.AdamW([{"params": backbone, "lr": args.lr * 0.1}, {"params": rest}],
                                  lr=args.lr, weight_decay=0.05)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    model.train()
    for it, (images, targets) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with amp_ctx:
            outputs = model(images)
        losses = criterion(outputs, targets)  # expect: AMP002
        loss = sum(losses[k] * criterion.weight_dict[k] for k in losses)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(optimizer)
        scaler.update()
        if it % 50 == 0:
            print(f"iter {it} " + " ".join(f"{k} {v.item():.3f}" for k, v in losses.items()))
        if it + 1 >= args.iters:
            break


if __name__ == "__main__":
    from torch.utils.data import DataLoader
    from torchvision.datasets import wrap_dataset_for_transforms_v2
    from torchvision.datasets import CocoDetection

    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/ade20k")
    p.add_argument("--num-classes", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--iters", type=int, default=160000)
    p.add_argument("--amp", action="store_true")
    args = p.parse_args()
    ds = wrap_dataset_for_transforms_v2(CocoDetection(args.root + "/images", args.root + "/ann.json"))
    train(args, DataLoader(ds, batch_size=16, shuffle=True, num_workers=8,
                           collate_fn=lambda b: (torch.stack([x[0] for x in b]), [x[1] for x in b])))
