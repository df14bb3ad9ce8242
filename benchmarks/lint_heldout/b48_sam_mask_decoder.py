"""SAM-lite: segment_anything's LayerNorm2d / TwoWayTransformer / MaskDecoder with a tiny ViT
encoder, trained from scratch on a small promptable segmentation set."""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerNorm2d(nn.Module):
    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class MLP(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, num_layers, sigmoid_output=False):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))
        self.sigmoid_output = sigmoid_output

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return torch.sigmoid(x) if self.sigmoid_output else x


class Attention(nn.Module):
    def __init__(self, embedding_dim, num_heads, downsample_rate=1):
        super().__init__()
        self.internal_dim = embedding_dim // downsample_rate
        self.num_heads = num_heads
        self.q_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.k_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.v_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.out_proj = nn.Linear(self.internal_dim, embedding_dim)

    def _separate_heads(self, x):
        b, n, c = x.shape
        return x.reshape(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

    def forward(self, q, k, v, key_padding_mask=None):
        q = self._separate_heads(self.q_proj(q))
        k = self._separate_heads(self.k_proj(k))
        v = self._separate_heads(self.v_proj(v))
        attn = q @ k.permute(0, 1, 3, 2) / q.shape[-1] ** 0.5
        if key_padding_mask is not None:
            # padded prompt points must not be attended to
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = torch.softmax(attn, dim=-1)
        return self.out_proj((attn @ v).transpose(1, 2).flatten(2))


class TwoWayBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_dim=512, skip_first_layer_pe=False):
        super().__init__()
        self.self_attn = Attention(dim, num_heads)
        self.cross_attn_token_to_image = Attention(dim, num_heads, downsample_rate=2)
        self.mlp = MLP(dim, mlp_dim, dim, 2)
        self.cross_attn_image_to_token = Attention(dim, num_heads, downsample_rate=2)
        self.norm1, self.norm2, self.norm3, self.norm4 = (nn.LayerNorm(dim) for _ in range(4))
        self.skip_first_layer_pe = skip_first_layer_pe

    def forward(self, queries, keys, query_pe, key_pe, pad_mask):
        if self.skip_first_layer_pe:
            queries = self.self_attn(queries, queries, queries, key_padding_mask=pad_mask)
        else:
            q = queries + query_pe
            queries = queries + self.self_attn(q, q, queries, key_padding_mask=pad_mask)
        queries = self.norm1(queries)
        q, k = queries + query_pe, keys + key_pe
        queries = self.norm2(queries + self.cross_attn_token_to_image(q, k, keys))
        queries = self.norm3(queries + self.mlp(queries))
        q, k = queries + query_pe, keys + key_pe
        keys = self.norm4(keys + self.cross_attn_image_to_token(k, q, queries))
        return queries, keys


class PositionEmbeddingRandom(nn.Module):
    def __init__(self, num_pos_feats=64, scale=1.0):
        super().__init__()
        self.register_buffer("gaussian", scale * torch.randn((2, num_pos_feats)))

    def _pe_encoding(self, coords):
        coords = (2 * coords - 1) @ self.gaussian
        coords = 2 * np.pi * coords
        return torch.cat([torch.sin(coords), torch.cos(coords)], dim=-1)

    def grid(self, h, w):
        grid = torch.ones((h, w), device=self.gaussian.device, dtype=torch.float32)
        y_embed = (grid.cumsum(dim=0) - 0.5) / h
        x_embed = (grid.cumsum(dim=1) - 0.5) / w
        return self._pe_encoding(torch.stack([x_embed, y_embed], dim=-1)).permute(2, 0, 1)

    def forward_with_coords(self, coords, image_size):
        return self._pe_encoding(coords / image_size)


class SamLite(nn.Module):
    def __init__(self, img_size=256, patch=16, dim=256, depth=4, num_mask_tokens=4):
        super().__init__()
        self.img_size, self.grid_size = img_size, img_size // patch
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, dim, self.grid_size, self.grid_size))
        self.vit = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 8, 4 * dim, batch_first=True, norm_first=True), depth)
        self.neck = nn.Sequential(nn.Conv2d(dim, dim, 1, bias=False), LayerNorm2d(dim),
                                  nn.Conv2d(dim, dim, 3, padding=1, bias=False), LayerNorm2d(dim))
        self.pe_layer = PositionEmbeddingRandom(dim // 2)
        self.point_embeddings = nn.ModuleList(nn.Embedding(1, dim) for _ in range(2))
        self.not_a_point_embed = nn.Embedding(1, dim)
        self.iou_token = nn.Embedding(1, dim)
        self.mask_tokens = nn.Embedding(num_mask_tokens, dim)
        self.layers = nn.ModuleList(TwoWayBlock(dim, 8, skip_first_layer_pe=(i == 0)) for i in range(2))
        self.final_attn = Attention(dim, 8, downsample_rate=2)
        self.norm_final = nn.LayerNorm(dim)
        self.output_upscaling = nn.Sequential(nn.ConvTranspose2d(dim, dim // 4, 2, stride=2), nn.GELU(),
                                              nn.ConvTranspose2d(dim // 4, dim // 8, 2, stride=2), nn.GELU())
        self.hypernet = nn.ModuleList(MLP(dim, dim, dim // 8, 3) for _ in range(num_mask_tokens))
        self.iou_head = MLP(dim, 256, num_mask_tokens, 3)

    def encode_image(self, images):
        x = self.patch_embed(images) + self.pos_embed
        b, c, h, w = x.shape
        x = self.vit(x.flatten(2).transpose(1, 2))
        return self.neck(x.transpose(1, 2).reshape(b, c, h, w))

    def forward(self, images, points, labels):
        src = self.encode_image(images)
        b, c, h, w = src.shape
        sparse = self.pe_layer.forward_with_coords(points + 0.5, self.img_size)
        sparse[labels == -1] = 0.0
        sparse[labels == -1] += self.not_a_point_embed.weight
        sparse[labels == 0] += self.point_embeddings[0].weight
        sparse[labels == 1] += self.point_embeddings[1].weight
        out_tokens = torch.cat([self.iou_token.weight, self.mask_tokens.weight], dim=0)
        tokens = torch.cat([out_tokens.unsqueeze(0).expand(b, -1, -1), sparse], dim=1)
        pad_mask = torch.cat([labels.new_zeros(b, out_tokens.shape[0]), labels], dim=1) == -1
        pos = self.pe_layer.grid(h, w).unsqueeze(0).flatten(2).permute(0, 2, 1)
        queries, keys = tokens, src.flatten(2).permute(0, 2, 1)
        for layer in self.layers:
            queries, keys = layer(queries, keys, tokens, pos, pad_mask)
        q, k = queries + tokens, keys + pos
        queries = self.norm_final(queries + self.final_attn(q, k, keys))
        upscaled = self.output_upscaling(keys.transpose(1, 2).reshape(b, c, h, w))
        hyper_in = torch.stack([mlp(queries[:, 1 + i, :]) for i, mlp in enumerate(self.hypernet)], dim=1)
        hyper_in = hyper_in / (hyper_in.norm(dim=-1, keepdim=True) + 1e-8)
        masks = (hyper_in @ upscaled.flatten(2)).view(b, -1, *upscaled.shape[-2:])
        return masks, self.iou_head(queries[:, 0, :])


def dice_loss(logits, targets, smooth=1.0):
    probs = logits.sigmoid().flatten(1)
    targets = targets.flatten(1)
    num = 2 * (probs * targets).sum(-1) + smooth
    den = probs.sum(-1) + targets.sum(-1) + smooth
    return (1 - num / den).mean()


def train_one_epoch(model, loader, optimizer, scaler, args, device):
    model.train()
    bce = nn.BCELoss()
    for step, batch in enumerate(loader):
        images, gt = batch["image"].to(device, non_blocking=True), batch["mask"].to(device, non_blocking=True)
        points, labels = batch["points"].to(device), batch["labels"].to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            masks, iou_pred = model(images, points, labels)
            gt_low = F.interpolate(gt, size=masks.shape[-2:], mode="nearest").expand_as(masks)
            loss_bce = bce(torch.sigmoid(masks), gt_low)  # expect: AMP003
            loss_dice = dice_loss(masks, gt_low)
        with torch.no_grad():
            pred_bin = (masks > 0).float()
            inter = (pred_bin * gt_low).sum(dim=(-1, -2))
            union = (pred_bin + gt_low).clamp(max=1).sum(dim=(-1, -2))
            iou_target = inter / (union + 1e-8)
        loss_iou = F.mse_loss(iou_pred, iou_target)  # expect: AMP002
        loss = loss_bce + loss_dice + args.iou_weight * loss_iou
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        if step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} iou {iou_target.mean().item():.3f}")


@torch.no_grad()
def evaluate(model, loader, device, amp=True):
    model.eval()
    dices = []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            masks, _ = model(batch["image"].to(device), batch["points"].to(device), batch["labels"].to(device))
            gt = F.interpolate(batch["mask"].to(device), size=masks.shape[-2:], mode="nearest")
            dices.append(1.0 - dice_loss(masks[:, :1], gt).item())
            mask_conf = masks.sigmoid().mean(dim=(-1, -2))
    return float(np.mean(dices)), mask_conf


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--amp", action="store_true")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--iou-weight", dest="iou_weight", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--log-every", dest="log_every", type=int, default=50)
    args = p.parse_args()
    device = torch.device("cuda")
    model = SamLite().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    train_loader = val_loader = []  # replaced by the dataset module in the real script
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scaler, args, device)
        print(epoch, evaluate(model, val_loader, device, amp=args.amp)[0])


if __name__ == "__main__":
    main()
