"""ConvNeXt stem + ViT trunk hybrid for multi-label attribute recognition.

Stages 1-2 are ConvNeXt blocks (channels-first LayerNorm2d, GRN, stochastic depth),
then a 1x1 bridge turns the feature map into tokens for a small ViT.
"""
import argparse
import copy
import logging
import math
import os
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from data.attributes import build_attribute_loaders
from utils.misc import AverageMeter, cosine_scheduler, save_on_master

logger = logging.getLogger("hybrid")

autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    return x * random_tensor / keep_prob


class DropPath(nn.Module):
    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class LayerNorm2d(nn.Module):
    """LayerNorm over channels for NCHW tensors; statistics are taken in fp32."""

    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        x = self.weight[:, None, None] * x + self.bias[:, None, None]
        return x.to(dtype)


class GRN(nn.Module):
    """Global response normalisation (ConvNeXt V2), channels-last input."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, dim))

    def forward(self, x):
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim, drop_path=0.0, norm_layer=partial(nn.LayerNorm, eps=1e-6)):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = norm_layer(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.grn = GRN(4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.dwconv(x)
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.grn(self.act(self.pwconv1(x)))
        x = self.pwconv2(x)
        x = x.permute(0, 3, 1, 2)
        return shortcut + self.drop_path(x)


class TokenStandardize(nn.Module):
    """Per-token standardisation with an affine map (no running stats)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # expect: AMP004
        var = x.var(-1, keepdim=True, unbiased=False)  # expect: AMP004
        return (x - mu) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def make_token_norm(kind, dim):
    if kind == "ln":
        return nn.LayerNorm(dim, eps=1e-6)
    if kind == "std":
        return TokenStandardize(dim)
    return nn.Identity()


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class HybridConvViT(nn.Module):
    def __init__(self, num_classes=40, dims=(96, 192), depths=(3, 3), embed_dim=384,
                 vit_depth=6, num_heads=6, drop_path_rate=0.1, token_norm="std", img_size=224):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4), LayerNorm2d(dims[0]))
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, sum(depths) + vit_depth)]
        self.stages = nn.ModuleList()
        cur = 0
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            layers = []
            if i > 0:
                layers += [LayerNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, kernel_size=2, stride=2)]
            layers += [ConvNeXtBlock(dim, drop_path=dpr[cur + j]) for j in range(depth)]
            self.stages.append(nn.Sequential(*layers))
            cur += depth
        self.bridge = nn.Conv2d(dims[-1], embed_dim, kernel_size=1)
        self.aux_head = nn.Linear(embed_dim, num_classes)
        self.token_norm = make_token_norm(token_norm, embed_dim)
        num_patches = (img_size // 8) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, drop_path=dpr[cur + j]) for j in range(vit_depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward_features(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        feat = self.bridge(x)
        aux_logits = self.aux_head(feat.mean(dim=(2, 3)))  # expect: AMP004
        tokens = self.token_norm(feat.flatten(2).transpose(1, 2))
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        x = torch.cat([cls, tokens], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return x, aux_logits

    def forward(self, x):
        x, aux_logits = self.forward_features(x)
        pooled = x[:, 1:].mean(dim=1)
        return self.head(pooled), aux_logits


class ModelEma:
    def __init__(self, model, decay=0.9998):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.dtype.is_floating_point:
                ema_v.mul_(self.decay).add_(model_v.detach(), alpha=1.0 - self.decay)


def train_one_epoch(model, loader, criterion, optimizer, scaler, lr_schedule, epoch, args, model_ema=None):
    model.train()
    loss_meter = AverageMeter()
    start = time.time()
    for it, (images, targets) in enumerate(loader):
        step = epoch * len(loader) + it
        for group in optimizer.param_groups:
            group["lr"] = lr_schedule[step]
        images = images.cuda(non_blocking=True).to(memory_format=torch.channels_last)
        targets = targets.cuda(non_blocking=True).float()

        with autocast(enabled=args.amp):
            logits, aux_logits = model(images)
            loss = criterion(logits, targets) + args.aux_weight * criterion(aux_logits, targets)
            if args.confidence_penalty > 0:
                p = torch.sigmoid(logits)
                log_p = torch.log(p + 1e-8)  # expect: AMP011
                loss = loss + args.confidence_penalty * (p.float() * log_p.float()).sum(dim=1).mean()

        if not math.isfinite(loss.item()):
            logger.error("loss is %s, stopping", loss.item())
            raise SystemExit(1)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        if model_ema is not None:
            model_ema.update(model)
        loss_meter.update(loss.item(), images.size(0))
        if it % args.print_freq == 0:
            logger.info("epoch %d it %d loss %.4f (%.1fs)", epoch, it, loss_meter.avg, time.time() - start)
    return loss_meter.avg


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    tp = fp = fn = 0.0
    for images, targets in loader:
        images = images.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        with autocast(enabled=args.amp):
            logits, _ = model(images)
        pred = logits.float().sigmoid() > 0.5
        tp += (pred & (targets > 0.5)).sum().item()
        fp += (pred & (targets <= 0.5)).sum().item()
        fn += (~pred & (targets > 0.5)).sum().item()
    precision = tp / max(tp + fp, 1.0)
    recall = tp / max(tp + fn, 1.0)
    return 2 * precision * recall / max(precision + recall, 1e-8)


def export_half(model, path):
    serving = copy.deepcopy(model).half().eval()
    torch.save(serving.state_dict(), path)


def param_groups_weight_decay(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or "pos_embed" in name or "cls_token" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def main():
    parser = argparse.ArgumentParser("hybrid convnext-vit")
    parser.add_argument("--data", default="/datasets/celeba")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--aux-weight", type=float, default=0.3)
    parser.add_argument("--confidence-penalty", type=float, default=0.0)
    parser.add_argument("--token-norm", default="std", choices=["ln", "std", "none"])
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--ema", action="store_true")
    parser.add_argument("--print-freq", type=int, default=50)
    parser.add_argument("--output", default="runs/hybrid")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.output, exist_ok=True)

    train_loader, val_loader, num_classes = build_attribute_loaders(args.data, args.batch_size)
    model = HybridConvViT(num_classes=num_classes, token_norm=args.token_norm)
    model = model.cuda().to(memory_format=torch.channels_last)
    model_ema = ModelEma(model) if args.ema else None

    criterion = nn.BCEWithLogitsLoss()
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, args.weight_decay), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    lr_schedule = cosine_scheduler(args.lr, 1e-6, args.epochs, len(train_loader), warmup_epochs=5)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, scaler, lr_schedule,
                                     epoch, args, model_ema=model_ema)
        f1 = evaluate(model, val_loader, args)
        logger.info("epoch %d train_loss %.4f val_f1 %.4f", epoch, train_loss, f1)
        if f1 > best_f1:
            best_f1 = f1
            save_on_master({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch},
                           os.path.join(args.output, "best.pth"))
    export_half(model_ema.module if model_ema is not None else model, os.path.join(args.output, "serving_fp16.pth"))


if __name__ == "__main__":
    main()
