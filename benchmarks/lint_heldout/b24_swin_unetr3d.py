"""Swin-UNETR-style 3D segmentation for BraTS (TC / WT / ET as three sigmoid channels)."""
import itertools

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_


def window_partition(x, ws):
    b, d, h, w, c = x.shape
    x = x.view(b, d // ws[0], ws[0], h // ws[1], ws[1], w // ws[2], ws[2], c)
    return x.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, ws[0] * ws[1] * ws[2], c)


def window_reverse(windows, ws, dims):
    b, d, h, w = dims
    x = windows.view(b, d // ws[0], h // ws[1], w // ws[2], ws[0], ws[1], ws[2], -1)
    return x.permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, d, h, w, -1)


def compute_mask(dims, ws, shift, device):
    img_mask = torch.zeros((1, *dims, 1), device=device)
    cnt = 0
    ranges = [(slice(-w), slice(-w, -s), slice(-s, None)) for w, s in zip(ws, shift)]
    for sd, sh, sw in itertools.product(*ranges):
        img_mask[:, sd, sh, sw, :] = cnt
        cnt += 1
    mask_windows = window_partition(img_mask, ws).squeeze(-1)
    attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))


class WindowAttention3d(nn.Module):
    def __init__(self, dim, heads, ws, drop_key=0.1):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.drop_key = drop_key
        n_rel = (2 * ws[0] - 1) * (2 * ws[1] - 1) * (2 * ws[2] - 1)
        self.rel_bias = nn.Parameter(torch.zeros(n_rel, heads))
        coords = torch.stack(torch.meshgrid(*[torch.arange(s) for s in ws], indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel += torch.tensor([w - 1 for w in ws])
        rel[:, :, 0] *= (2 * ws[1] - 1) * (2 * ws[2] - 1)
        rel[:, :, 1] *= 2 * ws[2] - 1
        self.register_buffer("rel_index", rel.sum(-1), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        nn.init.trunc_normal_(self.rel_bias, std=0.02)

    def forward(self, x, mask=None):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.training and self.drop_key > 0:
            # DropKey: mask keys before the softmax instead of dropping attention weights
            dropped = torch.bernoulli(torch.full_like(attn, self.drop_key)).bool()
            attn = attn.masked_fill(dropped, -1e12)  # expect: AMP007
        bias = self.rel_bias[self.rel_index[:n, :n].reshape(-1)].reshape(n, n, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(b // nw, nw, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class SwinBlock3d(nn.Module):
    def __init__(self, dim, heads, ws, shift, mlp_ratio=4.0):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.ws, self.shift = ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention3d(dim, heads, ws)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x, mask):
        b, d, h, w, c = x.shape
        shifted = any(self.shift)
        y = self.norm1(x)
        if shifted:
            y = torch.roll(y, shifts=[-s for s in self.shift], dims=(1, 2, 3))
        y = window_reverse(self.attn(window_partition(y, self.ws), mask if shifted else None), self.ws, (b, d, h, w))
        if shifted:
            y = torch.roll(y, shifts=list(self.shift), dims=(1, 2, 3))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging3d(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(8 * dim)
        self.reduction = nn.Linear(8 * dim, 2 * dim, bias=False)

    def forward(self, x):
        parts = [x[:, i::2, j::2, k::2, :] for i, j, k in itertools.product(range(2), repeat=3)]
        return self.reduction(self.norm(torch.cat(parts, -1)))


class BasicLayer(nn.Module):
    def __init__(self, dim, depth, heads, ws):
        super().__init__()
        self.ws = ws
        self.shift = tuple(s // 2 for s in ws)
        self.blocks = nn.ModuleList(
            SwinBlock3d(dim, heads, ws, (0, 0, 0) if i % 2 == 0 else self.shift) for i in range(depth)
        )
        self.downsample = PatchMerging3d(dim)

    def forward(self, x):
        _, _, d, h, w = x.shape
        x = x.permute(0, 2, 3, 4, 1)
        mask = compute_mask((d, h, w), self.ws, self.shift, x.device)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.downsample(x).permute(0, 4, 1, 2, 3)


class LayerNormCF(nn.Module):
    """LayerNorm over the channels of a (B, C, D, H, W) tensor, without permutes."""

    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None, None] * x + self.bias[:, None, None, None]


class UnetResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, padding=1, bias=False)
        self.norm1 = LayerNormCF(cout)
        self.conv2 = nn.Conv3d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = LayerNormCF(cout)
        self.skip = nn.Conv3d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x):
        h = F.leaky_relu(self.norm1(self.conv1(x)), 0.01)
        h = self.norm2(self.conv2(h))
        return F.leaky_relu(h + self.skip(x), 0.01)


class UnetrUpBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.up = nn.ConvTranspose3d(cin, cout, 2, stride=2, bias=False)
        self.block = UnetResBlock(2 * cout, cout)

    def forward(self, x, skip):
        return self.block(torch.cat([self.up(x), skip], 1))


class SwinUNETR(nn.Module):
    def __init__(self, in_ch=4, out_ch=3, feat=24, depths=(2, 2, 2, 2), heads=(3, 6, 12, 24), ws=(4, 4, 4)):
        super().__init__()
        self.patch_embed = nn.Conv3d(in_ch, feat, 2, stride=2)
        self.stages = nn.ModuleList(BasicLayer(feat * 2**i, depths[i], heads[i], ws) for i in range(4))
        self.enc0 = UnetResBlock(in_ch, feat)
        self.enc = nn.ModuleList(UnetResBlock(feat * 2**i, feat * 2**i) for i in range(4))
        self.bottleneck = nn.Conv3d(16 * feat, 16 * feat, 3, padding=1)
        self.ctx_fc = nn.Linear(16 * feat, 16 * feat)
        self.dec = nn.ModuleList(UnetrUpBlock(feat * 2 ** (i + 1), feat * 2**i) for i in reversed(range(4)))
        self.dec0 = UnetrUpBlock(feat, feat)
        self.out = nn.Conv3d(feat, out_ch, 1)

    @staticmethod
    def proj_out(x):
        x = x.permute(0, 2, 3, 4, 1)
        x = F.layer_norm(x, [x.shape[-1]])
        return x.permute(0, 4, 1, 2, 3)

    def forward(self, x_in):
        hidden = [self.patch_embed(x_in)]
        for stage in self.stages:
            hidden.append(stage(hidden[-1]))
        hidden = [self.proj_out(h) for h in hidden]
        skips = [blk(h) for blk, h in zip(self.enc, hidden[:4])]
        b = self.bottleneck(hidden[4])
        ctx = b.mean(dim=(2, 3, 4))  # expect: AMP004
        x = b + self.ctx_fc(ctx)[:, :, None, None, None]
        for up, skip in zip(self.dec, reversed(skips)):
            x = up(x, skip)
        return self.out(self.dec0(x, self.enc0(x_in)))


class DiceBCEEntropyLoss(nn.Module):
    """Soft Dice + BCE on the sigmoid channels, with a confidence penalty."""

    def __init__(self, smooth=1e-5, ent_weight=0.01):
        super().__init__()
        self.smooth, self.ent_weight = smooth, ent_weight

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        dims = (0, 2, 3, 4)
        inter = (probs * target).sum(dims)
        denom = probs.sum(dims) + target.sum(dims)
        dice = 1.0 - (2.0 * inter + self.smooth) / (denom + self.smooth)
        bce = F.binary_cross_entropy_with_logits(logits, target)
        entropy = -(probs * torch.log(probs + 1e-10)).sum(1).mean()  # expect: AMP011
        return dice.mean() + bce - self.ent_weight * entropy


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    scores = []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(batch["image"].to(device))
        pred, label = (torch.sigmoid(logits) > 0.5).float(), batch["label"].to(device)
        inter = (pred * label).sum((2, 3, 4))
        dice = (2 * inter + 1e-5) / (pred.sum((2, 3, 4)) + label.sum((2, 3, 4)) + 1e-5)
        scores.append(dice.mean().item())
    model.train()
    return float(np.mean(scores))


def train(train_loader, val_loader, max_epochs=300, lr=1e-4, accum_steps=2, device="cuda"):
    model = SwinUNETR().to(device)
    loss_fn = DiceBCEEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_epochs)
    scaler = torch.amp.GradScaler("cuda")
    best = -1.0
    for epoch in range(max_epochs):
        model.train()
        for it, batch in enumerate(train_loader):
            image, label = batch["image"].to(device), batch["label"].to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(image)
                loss = loss_fn(logits, label)
            scaler.scale(loss / accum_steps).backward()
            if (it + 1) % accum_steps == 0:
                clip_grad_norm_(model.parameters(), 12.0)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if (epoch + 1) % 10 == 0:
            dice = validate(model, val_loader, device)
            if dice > best:
                best = dice
                torch.save(model.state_dict(), "best_metric_model.pt")
            print(f"epoch {epoch + 1}: mean dice {dice:.4f} (best {best:.4f})")
    return model
