"""Document-image classifier: a ViT over variable-size scans, distilled from a larger teacher.

Scans are padded to the largest page in the batch; the padding is tracked per patch and
masked out of attention so that page size does not leak into the prediction.
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from docdata import ScanFolder, pad_collate  # project-local dataset helpers


class PatchEmbed(nn.Module):
    def __init__(self, patch=16, in_ch=3, dim=384):
        super().__init__()
        self.patch = patch
        self.proj = nn.Conv2d(in_ch, dim, kernel_size=patch, stride=patch)

    def forward(self, x, pixel_mask):
        x = self.proj(x).flatten(2).transpose(1, 2)
        # a patch is valid if any of its pixels is real page content
        key_mask = F.max_pool2d(pixel_mask[:, None].float(), self.patch).flatten(1) > 0
        return x, key_mask


class Attention(nn.Module):
    def __init__(self, dim, heads=6, attn_drop=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x, key_mask=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if key_mask is not None:
            attn = attn.masked_fill(~key_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.attn_drop(attn.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, drop=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Dropout(drop),
                                 nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, key_mask):
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.mlp(self.norm2(x))


class DocViT(nn.Module):
    def __init__(self, num_classes, dim=384, depth=12, heads=6, max_patches=4096):
        super().__init__()
        self.patch_embed = PatchEmbed(dim=dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, max_patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes, bias=False)

    def forward_features(self, images, pixel_mask):
        x, key_mask = self.patch_embed(images, pixel_mask)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed[:, : x.shape[1]]
        key_mask = F.pad(key_mask, (1, 0), value=True)
        for blk in self.blocks:
            x = blk(x, key_mask)
        return self.norm(x)[:, 0]

    def forward(self, images, pixel_mask):
        return self.head(self.forward_features(images, pixel_mask))


@torch.no_grad()
def estimate_pixel_stats(loader, device, max_batches=50):
    means, variances = [], []
    for i, (images, pixel_mask, _) in enumerate(loader):
        if i >= max_batches:
            break
        x = images.to(device, non_blocking=True).half()
        means.append(x.mean(dim=(0, 2, 3)))  # expect: AMP004
        variances.append(x.float().var(dim=(0, 2, 3)))
    return torch.stack(means).float().mean(0), torch.stack(variances).mean(0).sqrt()


def export_fp16_checkpoint(model, path):
    slim = copy.deepcopy(model).half()
    torch.save({"model": slim.state_dict()}, path)


def cosine_lr(step, total, warmup, base_lr):
    if step < warmup:
        return base_lr * step / max(1, warmup)
    return 0.5 * base_lr * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--num-classes", type=int, default=16)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--cos-scale", type=float, default=16.0)
    p.add_argument("--kd-alpha", type=float, default=0.5)
    p.add_argument("--kd-temp", type=float, default=2.0)
    p.add_argument("--out", default="runs/docvit")
    args = p.parse_args()

    device = torch.device("cuda")
    train_set = ScanFolder(os.path.join(args.data, "train"))
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                        collate_fn=pad_collate, pin_memory=True, drop_last=True)
    mean, std = estimate_pixel_stats(loader, device)
    train_set.set_normalization(mean.cpu(), std.cpu())

    model = DocViT(args.num_classes).to(device)
    teacher = torch.load(args.teacher, map_location=device, weights_only=False).eval()
    for p_ in teacher.parameters():
        p_.requires_grad_(False)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")
    total = args.epochs * len(loader)
    step = 0
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for images, pixel_mask, labels in loader:
            images = images.to(device, non_blocking=True)
            pixel_mask = pixel_mask.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, total, 2000, args.lr)

            with torch.autocast(device_type="cuda", dtype=torch.float16):
                feats = model.forward_features(images, pixel_mask)
                cos = F.linear(F.normalize(feats, dim=-1), F.normalize(model.head.weight, dim=-1))
                ce = F.cross_entropy(cos * args.cos_scale, labels, label_smoothing=0.1)
                with torch.no_grad():
                    t_logits = teacher(images, pixel_mask).float()
                z_s = (cos - cos.mean(-1, keepdim=True)) / (cos.std(-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011
                z_t = (t_logits - t_logits.mean(-1, keepdim=True)) / (t_logits.std(-1, keepdim=True) + 1e-8)
                kd = F.kl_div(F.log_softmax(z_s / args.kd_temp, dim=-1),
                              F.softmax(z_t / args.kd_temp, dim=-1), reduction="batchmean")
                loss = (1 - args.kd_alpha) * ce + args.kd_alpha * kd * args.kd_temp ** 2

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} ce {ce.item():.4f} "
                      f"kd {kd.item():.4f} scale {scaler.get_scale():.0f}")

        print(f"epoch {epoch} took {time.time() - t0:.1f}s")
        torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))

    export_fp16_checkpoint(model, os.path.join(args.out, "docvit_fp16.pt"))


if __name__ == "__main__":
    main()
