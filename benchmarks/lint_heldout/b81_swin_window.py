"""Swin-style hierarchical transformer for fine-grained classification.

Shifted-window attention with a relative position bias table.  Optionally the last
stage switches to global attention with a key-padding mask, so that letterboxed images
of different aspect ratios can share a batch (``--global-last-stage``).
"""
import argparse
import contextlib
import copy
import logging
import os

import torch
from torch import nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

from timm.data import Mixup
from timm.layers import DropPath, Mlp, trunc_normal_
from timm.loss import SoftTargetCrossEntropy

from fgvc.data import build_loader
from fgvc.scheduler import build_cosine_scheduler
from fgvc.utils import ModelEma, load_pretrained_swin, save_checkpoint

_logger = logging.getLogger(__name__)


def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)


def window_reverse(windows, ws, H, W):
    B = windows.shape[0] // ((H // ws) * (W // ws))
    x = windows.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, -1)


def relative_position_index(ws):
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous() + (ws - 1)
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1)


class _AttentionBase(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _scores(self, q, k):
        return (q * self.scale) @ k.transpose(-2, -1)

    def _apply_mask(self, attn, mask):
        return attn

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = self._scores(q, k)
        if mask is not None:
            attn = self._apply_mask(attn, mask)
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj_drop(self.proj(x))


class WindowAttention(_AttentionBase):
    def __init__(self, dim, num_heads, window_size, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.window_size = window_size
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window_size - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window_size), persistent=False)
        trunc_normal_(self.relative_position_bias_table, std=0.02)

    def _rel_bias(self):
        n = self.window_size ** 2
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, -1).permute(2, 0, 1).contiguous()

    def _scores(self, q, k):
        return super()._scores(q, k) + self._rel_bias().unsqueeze(0)

    def _apply_mask(self, attn, mask):
        nW, N = mask.shape[0], attn.shape[-1]
        attn = attn.view(-1, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
        return attn.view(-1, self.num_heads, N, N)


class GlobalAttention(_AttentionBase):
    """Full attention over the tokens of a stage; ``mask`` marks the valid (non-padded) tokens."""

    def _apply_mask(self, attn, mask):
        return attn.masked_fill(~mask[:, None, None, :], -1e9)  # expect: AMP007


class SwinBlock(nn.Module):
    def __init__(self, dim, num_heads, window_size=7, shift=0, mlp_ratio=4.0, drop_path=0.0,
                 attn_layer=WindowAttention, norm_layer=nn.LayerNorm):
        super().__init__()
        self.window_size = window_size
        self.shift = shift
        self.global_attn = attn_layer is GlobalAttention
        self.norm1 = norm_layer(dim)
        if self.global_attn:
            self.attn = attn_layer(dim, num_heads)
        else:
            self.attn = attn_layer(dim, num_heads, window_size)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)

    def _shift_mask(self, H, W, device):
        img_mask = torch.zeros((1, H, W, 1), device=device)
        ws, s = self.window_size, self.shift
        cnt = 0
        for h in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
            for w in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
                img_mask[:, h, w, :] = cnt
                cnt += 1
        mask_windows = window_partition(img_mask, ws).squeeze(-1)
        attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
        return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))

    def forward(self, x, H, W, valid=None):
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x)
        if self.global_attn:
            x = self.attn(x, valid)
        else:
            ws = self.window_size
            x = x.view(B, H, W, C)
            pad_b = (ws - H % ws) % ws
            pad_r = (ws - W % ws) % ws
            x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
            Hp, Wp = H + pad_b, W + pad_r
            mask = None
            if self.shift > 0:
                x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
                mask = self._shift_mask(Hp, Wp, x.device)
            win = self.attn(window_partition(x, ws), mask)
            x = window_reverse(win, ws, Hp, Wp)
            if self.shift > 0:
                x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
            x = x[:, :H, :W, :].reshape(B, H * W, C)
        x = shortcut + self.drop_path(x)
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    def __init__(self, dim, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm = norm_layer(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x, H, W):
        B, L, C = x.shape
        x = x.view(B, H, W, C)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class AvgPoolHead(nn.Module):
    def __init__(self, dim, num_classes):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x, valid=None):
        x = self.norm(x)
        if valid is None:
            x = x.mean(dim=1)
        else:
            m = valid.unsqueeze(-1).to(x.dtype)
            x = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return self.fc(x)


class AttnPoolHead(nn.Module):
    def __init__(self, dim, num_classes):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.score = nn.Linear(dim, 1)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x, valid=None):
        x = self.norm(x)
        scores = self.score(x).squeeze(-1)
        if valid is not None:
            scores = torch.where(valid, scores, torch.tensor(-1e9, device=scores.device))  # expect: AMP007
        weights = scores.softmax(dim=1)
        return self.fc((weights.unsqueeze(-1) * x).sum(dim=1))


POOL_HEADS = {"avg": AvgPoolHead, "attn": AttnPoolHead}


def build_stage(dim, depth, num_heads, window_size, dpr, attn_layer):
    return nn.ModuleList([
        SwinBlock(dim, num_heads, window_size, shift=0 if j % 2 == 0 else window_size // 2,
                  drop_path=dpr[j], attn_layer=attn_layer)
        for j in range(depth)
    ])


class SwinLite(nn.Module):
    def __init__(self, patch_size=4, in_chans=3, num_classes=1000, embed_dim=96, depths=(2, 2, 6, 2),
                 num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=0.2, global_last_stage=False,
                 pool="avg", use_checkpoint=False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        self.patch_norm = nn.LayerNorm(embed_dim)
        dpr = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        self.stages = nn.ModuleList()
        self.downsamples = nn.ModuleList()
        dim = embed_dim
        for i, (d, h) in enumerate(zip(depths, num_heads)):
            last = i == len(depths) - 1
            attn_layer = GlobalAttention if (global_last_stage and last) else WindowAttention
            self.stages.append(build_stage(dim, d, h, window_size, dpr[sum(depths[:i]):sum(depths[:i + 1])], attn_layer))
            self.downsamples.append(nn.Identity() if last else PatchMerging(dim))
            dim = dim if last else dim * 2
        self.num_features = dim
        self.head = POOL_HEADS[pool](dim, num_classes)

    def no_weight_decay(self):
        return {"relative_position_bias_table"}

    def reset_classifier(self, num_classes):
        self.head.fc = nn.Linear(self.num_features, num_classes)

    def forward(self, x, valid=None):
        x = self.patch_embed(x)
        B, C, H, W = x.shape
        x = self.patch_norm(x.flatten(2).transpose(1, 2))
        tok_valid = None
        for i, (blocks, down) in enumerate(zip(self.stages, self.downsamples)):
            if valid is not None and i == len(self.stages) - 1:
                tok_valid = F.interpolate(valid[:, None].float(), size=(H, W), mode="nearest")[:, 0].bool().flatten(1)
            for blk in blocks:
                if self.use_checkpoint and self.training:
                    x = cp.checkpoint(blk, x, H, W, tok_valid, use_reentrant=False)
                else:
                    x = blk(x, H, W, tok_valid)
            if not isinstance(down, nn.Identity):
                x = down(x, H, W)
                H, W = (H + 1) // 2, (W + 1) // 2
        return self.head(x, tok_valid)


def train_one_epoch(model, loader, criterion, optimizer, scaler, amp_ctx, mixup_fn, lr_sched, epoch, args, ema=None):
    model.train()
    num_steps = len(loader)
    optimizer.zero_grad(set_to_none=True)
    for step, (images, targets, valid) in enumerate(loader):
        images, targets = images.cuda(non_blocking=True), targets.cuda(non_blocking=True)
        valid = valid.cuda(non_blocking=True) if args.global_last_stage else None
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)

        with amp_ctx:
            logits = model(images, valid)
            loss = criterion(logits, targets)
        loss = loss / args.accum_steps
        scaler.scale(loss).backward()

        if (step + 1) % args.accum_steps == 0:
            if args.clip_grad:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(model)
        lr_sched.step_update(epoch * num_steps + step)
        if step % args.print_freq == 0:
            _logger.info("epoch %d [%d/%d] loss %.4f lr %.3e", epoch, step, num_steps,
                         loss.item() * args.accum_steps, optimizer.param_groups[0]["lr"])


@torch.no_grad()
def evaluate(model, loader, amp_ctx, use_valid):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for images, targets, valid in loader:
        images, targets = images.cuda(non_blocking=True), targets.cuda(non_blocking=True)
        with amp_ctx:
            logits = model(images, valid.cuda() if use_valid else None)
        loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").item()
        correct += (logits.argmax(dim=-1) == targets).sum().item()
        total += targets.numel()
    return correct / total, loss_sum / total


def finetune_lowmem(args):
    """Single-GPU fine-tuning of a pretrained checkpoint on a small FGVC set (384px, 16 GB cards)."""
    device = torch.device("cuda")
    model = SwinLite(window_size=args.window_size, num_classes=1000, pool=args.pool)
    load_pretrained_swin(model, args.pretrained)
    model.reset_classifier(args.num_classes)
    model = model.half()  # expect: AMP001
    model.to(device)

    skip = model.no_weight_decay()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not any(s in n for s in skip)]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or any(s in n for s in skip)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)  # expect: AMP011
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    loader = build_loader(args, is_train=True)
    param_dtype = next(model.parameters()).dtype

    model.train()
    for epoch in range(args.epochs):
        for images, targets, _ in loader:
            images = images.to(device, dtype=param_dtype, non_blocking=True)
            loss = criterion(model(images), targets.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        _logger.info("ft epoch %d loss %.4f", epoch, loss.item())
    save_checkpoint({"model": model.state_dict()}, os.path.join(args.output, "finetuned.pth"))


def export_half(model, path):
    torch.save(copy.deepcopy(model).half().eval().state_dict(), path)


def main(args):
    model = SwinLite(window_size=args.window_size, num_classes=args.num_classes, drop_path_rate=args.drop_path,
                     global_last_stage=args.global_last_stage, pool=args.pool, use_checkpoint=args.use_checkpoint)
    model.cuda()
    ema = ModelEma(model, decay=args.ema_decay) if args.ema_decay > 0 else None

    skip = model.no_weight_decay()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not any(s in n for s in skip)]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or any(s in n for s in skip)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else contextlib.nullcontext()

    use_mix = args.mixup > 0 or args.cutmix > 0
    mixup_fn = Mixup(args.mixup, args.cutmix, label_smoothing=args.smoothing, num_classes=args.num_classes) if use_mix else None
    criterion = SoftTargetCrossEntropy() if mixup_fn is not None else nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    train_loader, val_loader = build_loader(args, is_train=True), build_loader(args, is_train=False)
    lr_sched = build_cosine_scheduler(optimizer, args, len(train_loader))

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, amp_ctx, mixup_fn, lr_sched, epoch, args, ema)
        acc, val_loss = evaluate(model, val_loader, amp_ctx, args.global_last_stage)
        _logger.info("epoch %d val acc %.4f loss %.4f", epoch, acc, val_loss)
        if acc > best_acc:
            best_acc = acc
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.output, "best.pth"))
    if args.export:
        export_half(ema.module if ema is not None else model, os.path.join(args.output, "serving_fp16.pth"))


_ARGS = [
    ("--data-path", str, None), ("--output", str, "output/swin_fgvc"), ("--pretrained", str, ""),
    ("--num-classes", int, 200), ("--window-size", int, 12), ("--pool", str, "avg"),
    ("--drop-path", float, 0.2), ("--epochs", int, 100), ("--lr", float, 5e-4), ("--weight-decay", float, 0.05),
    ("--accum-steps", int, 1), ("--clip-grad", float, 5.0), ("--mixup", float, 0.8), ("--cutmix", float, 1.0),
    ("--smoothing", float, 0.1), ("--ema-decay", float, 0.0), ("--print-freq", int, 50),
]
_FLAGS = ["--global-last-stage", "--use-checkpoint", "--amp", "--export", "--finetune-lowmem"]


def get_args():
    p = argparse.ArgumentParser("SwinLite FGVC")
    for name, typ, default in _ARGS:
        p.add_argument(name, type=typ, default=default)
    for name in _FLAGS:
        p.add_argument(name, action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    cli = get_args()
    if cli.finetune_lowmem:
        finetune_lowmem(cli)
    else:
        main(cli)
