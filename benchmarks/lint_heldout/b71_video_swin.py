"""Video Swin Transformer (3D shifted-window attention with relative position
bias) for egocentric action recognition with separate verb / noun heads.

A TEA-style motion-excitation gate sits after the 3D patch embedding. Training
uses bf16 autocast.
"""
import argparse
import logging
import os
import time
from functools import lru_cache, reduce
from operator import mul

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn
from timm.layers import DropPath, trunc_normal_

from video.data import build_video_loader
from video.mixup import VerbNounMixup
from video.utils import cosine_scheduler, save_on_master

logger = logging.getLogger("vswin")

SWIN_CFGS = {
    "swin_t": dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=(8, 7, 7), drop_path=0.1),
    "swin_s": dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), window_size=(8, 7, 7), drop_path=0.2),
    "swin_b": dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=(8, 7, 7), drop_path=0.3),
}


def window_partition(x, ws):
    B, D, H, W, C = x.shape
    x = x.view(B, D // ws[0], ws[0], H // ws[1], ws[1], W // ws[2], ws[2], C)
    return x.permute(0, 1, 3, 5, 2, 4, 6, 7).contiguous().view(-1, reduce(mul, ws), C)


def window_reverse(windows, ws, B, D, H, W):
    x = windows.view(B, D // ws[0], H // ws[1], W // ws[2], ws[0], ws[1], ws[2], -1)
    return x.permute(0, 1, 4, 2, 5, 3, 6, 7).contiguous().view(B, D, H, W, -1)


def get_window_size(x_size, window_size, shift_size):
    use_ws, use_ss = list(window_size), list(shift_size)
    for i in range(len(x_size)):
        if x_size[i] <= window_size[i]:
            use_ws[i] = x_size[i]
            use_ss[i] = 0
    return tuple(use_ws), tuple(use_ss)


@lru_cache()
def compute_mask(D, H, W, ws, ss, device):
    img_mask = torch.zeros((1, D, H, W, 1), device=device)
    cnt = 0
    for d in (slice(-ws[0]), slice(-ws[0], -ss[0]), slice(-ss[0], None)):
        for h in (slice(-ws[1]), slice(-ws[1], -ss[1]), slice(-ss[1], None)):
            for w in (slice(-ws[2]), slice(-ws[2], -ss[2]), slice(-ss[2], None)):
                img_mask[:, d, h, w, :] = cnt
                cnt += 1
    mask_windows = window_partition(img_mask, ws).squeeze(-1)
    attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))


class Mlp(nn.Module):
    def __init__(self, dim, hidden, act="GELU", drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = getattr(nn, act)()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class WindowAttention3D(nn.Module):
    def __init__(self, dim, window_size, num_heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        wd, wh, ww = window_size
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * wd - 1) * (2 * wh - 1) * (2 * ww - 1), num_heads)
        )
        coords = torch.stack(torch.meshgrid(torch.arange(wd), torch.arange(wh), torch.arange(ww), indexing="ij"))
        coords = torch.flatten(coords, 1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += wd - 1
        rel[:, :, 1] += wh - 1
        rel[:, :, 2] += ww - 1
        rel[:, :, 0] *= (2 * wh - 1) * (2 * ww - 1)
        rel[:, :, 1] *= 2 * ww - 1
        self.register_buffer("relative_position_index", rel.sum(-1), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index[:N, :N].reshape(-1)].reshape(N, N, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj_drop(self.proj(x))


class SwinBlock3D(nn.Module):
    def __init__(self, dim, num_heads, window_size, shift_size, mlp_ratio=4.0, drop_path=0.0, use_checkpoint=False):
        super().__init__()
        self.window_size, self.shift_size = window_size, shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention3D(dim, window_size, num_heads)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.use_checkpoint = use_checkpoint

    def _attn(self, x, mask):
        B, D, H, W, C = x.shape
        ws, ss = get_window_size((D, H, W), self.window_size, self.shift_size)
        x = self.norm1(x)
        pd, pb, pr = [(ws[i] - s % ws[i]) % ws[i] for i, s in enumerate((D, H, W))]
        x = F.pad(x, (0, 0, 0, pr, 0, pb, 0, pd))
        _, Dp, Hp, Wp, _ = x.shape
        if any(s > 0 for s in ss):
            x = torch.roll(x, shifts=(-ss[0], -ss[1], -ss[2]), dims=(1, 2, 3))
        else:
            mask = None
        windows = self.attn(window_partition(x, ws), mask=mask)
        x = window_reverse(windows.view(-1, *ws, C), ws, B, Dp, Hp, Wp)
        if any(s > 0 for s in ss):
            x = torch.roll(x, shifts=ss, dims=(1, 2, 3))
        return x[:, :D, :H, :W, :].contiguous()

    def forward(self, x, mask):
        if self.use_checkpoint and self.training:
            x = x + self.drop_path(checkpoint.checkpoint(self._attn, x, mask, use_reentrant=False))
        else:
            x = x + self.drop_path(self._attn(x, mask))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        H, W = x.shape[2], x.shape[3]
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x = torch.cat([x[:, :, 0::2, 0::2], x[:, :, 1::2, 0::2], x[:, :, 0::2, 1::2], x[:, :, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x))


class BasicLayer(nn.Module):
    def __init__(self, dim, depth, num_heads, window_size, drop_path, downsample, use_checkpoint=False):
        super().__init__()
        self.window_size = window_size
        self.shift_size = tuple(w // 2 for w in window_size)
        self.blocks = nn.ModuleList([
            SwinBlock3D(dim, num_heads, window_size, (0, 0, 0) if i % 2 == 0 else self.shift_size,
                        drop_path=drop_path[i], use_checkpoint=use_checkpoint)
            for i in range(depth)
        ])
        self.downsample = PatchMerging(dim) if downsample else None

    def forward(self, x):  # x: B C D H W
        B, C, D, H, W = x.shape
        ws, ss = get_window_size((D, H, W), self.window_size, self.shift_size)
        x = x.permute(0, 2, 3, 4, 1)
        Dp, Hp, Wp = [-(-s // w) * w for s, w in zip((D, H, W), ws)]
        mask = compute_mask(Dp, Hp, Wp, ws, ss, x.device)
        for blk in self.blocks:
            x = blk(x, mask)
        if self.downsample is not None:
            x = self.downsample(x)
        return x.permute(0, 4, 1, 2, 3)


class PatchEmbed3D(nn.Module):
    def __init__(self, patch_size=(2, 4, 4), in_chans=3, embed_dim=96):
        super().__init__()
        self.proj = nn.Conv3d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x):
        x = self.proj(x)
        return self.norm(x.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)


class MotionExcitation(nn.Module):
    """Channel gate computed from frame-to-frame feature differences."""

    def __init__(self, dim, reduction=8):
        super().__init__()
        r = dim // reduction
        self.squeeze = nn.Conv3d(dim, r, 1)
        self.diff_conv = nn.Conv3d(r, r, (1, 3, 3), padding=(0, 1, 1), groups=r)
        self.expand = nn.Conv3d(r, dim, 1)

    def forward(self, x):  # B C T H W
        s = self.squeeze(x)
        diff = self.diff_conv(s[:, :, 1:]) - s[:, :, :-1]
        diff = F.pad(diff, (0, 0, 0, 0, 0, 1))
        pooled = diff.mean(dim=(3, 4), keepdim=True)  # expect: AMP004
        gate = torch.sigmoid(self.expand(pooled))
        gate = gate / (gate.amax(dim=2, keepdim=True) + 1e-8)
        return x + x * (gate - 0.5)


class VerbNounHead(nn.Module):
    def __init__(self, in_dim, num_classes, proj_dim=768, dropout=0.5):
        super().__init__()
        self.proj = nn.Linear(in_dim, proj_dim)
        self.dropout = nn.Dropout(dropout)
        self.heads = nn.ModuleDict({name: nn.Linear(proj_dim, n) for name, n in num_classes.items()})

    def forward(self, x):  # B D H W C, already layer-normed
        tokens = self.proj(x.flatten(1, 3))
        clip = tokens.mean(dim=1)  # expect: AMP004
        clip = self.dropout(F.gelu(clip))
        return {name: head(clip) for name, head in self.heads.items()}


class SwinTransformer3D(nn.Module):
    def __init__(self, cfg, num_classes, use_me=True, use_checkpoint=False):
        super().__init__()
        dim = cfg["embed_dim"]
        self.patch_embed = PatchEmbed3D(embed_dim=dim)
        self.motion = MotionExcitation(dim) if use_me else nn.Identity()
        self.pos_drop = nn.Dropout(0.0)
        dpr = torch.linspace(0, cfg["drop_path"], sum(cfg["depths"])).tolist()
        layers, start = [], 0
        for i, depth in enumerate(cfg["depths"]):
            layers.append(BasicLayer(dim * 2 ** i, depth, cfg["num_heads"][i], cfg["window_size"],
                                     dpr[start:start + depth], downsample=i < len(cfg["depths"]) - 1,
                                     use_checkpoint=use_checkpoint))
            start += depth
        self.layers = nn.ModuleList(layers)
        self.num_features = dim * 2 ** (len(cfg["depths"]) - 1)
        self.norm = nn.LayerNorm(self.num_features)
        self.head = VerbNounHead(self.num_features, num_classes)

    def forward_features(self, x):
        x = self.pos_drop(self.motion(self.patch_embed(x)))
        for layer in self.layers:
            x = layer(x.contiguous())
        return self.norm(x.permute(0, 2, 3, 4, 1))

    def forward(self, x):
        return self.head(self.forward_features(x))

    @torch.no_grad()
    def extract_embedding(self, x):
        return self.forward_features(x).mean(dim=(1, 2, 3))


def build_model(cfg_name, num_classes, **kw):
    return SwinTransformer3D(SWIN_CFGS[cfg_name], num_classes, **kw)


class VerbNounLoss(nn.Module):
    def __init__(self, weights=None, label_smoothing=0.1):
        super().__init__()
        self.weights = weights or {}
        self.label_smoothing = label_smoothing

    def forward(self, outputs, targets):
        losses = {}
        for name, logits in outputs.items():
            t = targets[name]
            if t.dim() == 2:  # soft targets from mixup
                losses[name] = torch.sum(-t * F.log_softmax(logits, dim=-1), dim=-1).mean()
            else:
                losses[name] = F.cross_entropy(logits, t, label_smoothing=self.label_smoothing)
        total = sum(self.weights.get(k, 1.0) * v for k, v in losses.items())
        return total, {k: v.detach() for k, v in losses.items()}


def train_one_epoch(model, criterion, loader, optimizer, scaler, lr_schedule, mixup, epoch, args):
    model.train()
    t0 = time.time()
    for it, (clips, targets) in enumerate(loader):
        step = epoch * len(loader) + it
        for g in optimizer.param_groups:
            g["lr"] = lr_schedule[step] * g.get("lr_scale", 1.0)
        clips = clips.cuda(non_blocking=True)
        targets = {k: v.cuda(non_blocking=True) for k, v in targets.items()}
        if mixup is not None:
            clips, targets = mixup(clips, targets)

        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            outputs = model(clips)
            loss, parts = criterion(outputs, targets)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()

        if it % args.print_freq == 0:
            verb_std = outputs["verb"].detach().std().item()  # expect: AMP004
            logger.info("ep %d it %d loss %.4f verb %.4f noun %.4f gnorm %.2f verb-logit-std %.3f (%.1fs)",
                        epoch, it, loss.item(), parts["verb"].item(), parts["noun"].item(), grad_norm.item(),
                        verb_std, time.time() - t0)


@torch.no_grad()
def validate(model, loader):
    model.eval()
    hits = {"verb": 0, "noun": 0, "action": 0}
    n = 0
    for clips, targets in loader:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            outputs = model(clips.cuda(non_blocking=True))
        pred = {k: v.float().argmax(-1).cpu() for k, v in outputs.items()}
        ok_v = pred["verb"] == targets["verb"]
        ok_n = pred["noun"] == targets["noun"]
        hits["verb"] += ok_v.sum().item()
        hits["noun"] += ok_n.sum().item()
        hits["action"] += (ok_v & ok_n).sum().item()
        n += clips.shape[0]
    return {k: v / max(n, 1) for k, v in hits.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--model", default="swin_t", choices=list(SWIN_CFGS))
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--clip-grad", type=float, default=5.0)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    p.add_argument("--print-freq", type=int, default=20)
    p.add_argument("--output", default="out/vswin")
    args = p.parse_args()

    train_loader, val_loader, num_classes = build_video_loader(args.data_root, args.batch_size)
    model = build_model(args.model, num_classes, use_checkpoint=args.checkpoint).cuda()
    decay = [p_ for n_, p_ in model.named_parameters() if p_.ndim > 1 and "relative_position" not in n_]
    no_decay = [p_ for n_, p_ in model.named_parameters() if p_.ndim <= 1 or "relative_position" in n_]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    lr_schedule = cosine_scheduler(args.lr, args.min_lr, args.epochs, len(train_loader), args.warmup_epochs)
    mixup = VerbNounMixup(alpha=args.mixup, num_classes=num_classes) if args.mixup > 0 else None
    criterion = VerbNounLoss(weights={"verb": 1.0, "noun": 1.0})

    best_action = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, optimizer, scaler, lr_schedule, mixup, epoch, args)
        stats = validate(model, val_loader)
        if stats["action"] > best_action:
            best_action = stats["action"]
            save_on_master({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.output, "best.pth"))
        logger.info("epoch %d verb %.4f noun %.4f action %.4f", epoch, stats["verb"], stats["noun"], stats["action"])


if __name__ == "__main__":
    main()
