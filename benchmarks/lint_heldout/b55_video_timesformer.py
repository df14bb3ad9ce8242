"""Video action recognition with a TimeSformer-style divided space-time transformer.

train.py of a small research repo: clip dataset stub, mixup/cutmix with soft targets,
an auxiliary multi-label tag head, AMP with torch.amp.autocast("cuda"), multi-view test.
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

MEAN = torch.tensor([0.45, 0.45, 0.45]).view(1, 1, 3, 1, 1) * 255.0
STD = torch.tensor([0.225, 0.225, 0.225]).view(1, 1, 3, 1, 1) * 255.0


class ClipDataset(Dataset):
    """Stub: uint8 clips (T, C, H, W), a frame-validity mask, a class and multi-hot tags."""

    def __init__(self, n_videos, num_frames=8, size=224, num_classes=400, num_tags=64):
        self.n, self.T, self.size = n_videos, num_frames, size
        self.num_classes, self.num_tags = num_classes, num_tags

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        clip = torch.randint(0, 256, (self.T, 3, self.size, self.size), dtype=torch.uint8)
        frame_mask = torch.zeros(self.T, dtype=torch.bool)
        frame_mask[: np.random.randint(self.T // 2, self.T + 1)] = True
        tags = (torch.rand(self.num_tags) < 0.1).float()
        return clip, frame_mask, idx % self.num_classes, tags


def normalize_clip(clip):
    return (clip.float() - MEAN.to(clip.device)) / STD.to(clip.device)


class Mixup:
    def __init__(self, alpha=0.8, cutmix_alpha=1.0, prob=1.0, smoothing=0.1, num_classes=400):
        self.alpha, self.cutmix_alpha, self.prob = alpha, cutmix_alpha, prob
        self.smoothing, self.num_classes = smoothing, num_classes

    def one_hot(self, target, lam):
        off = self.smoothing / self.num_classes
        on = 1.0 - self.smoothing + off
        y1 = torch.full((target.size(0), self.num_classes), off, device=target.device)
        y1 = y1.scatter_(1, target.unsqueeze(1), on)
        return y1 * lam + y1.flip(0) * (1.0 - lam)

    def __call__(self, x, target):
        if np.random.rand() > self.prob:
            return x, self.one_hot(target, 1.0)
        if np.random.rand() < 0.5:
            lam = float(np.random.beta(self.alpha, self.alpha))
            x = x * lam + x.flip(0) * (1.0 - lam)
        else:
            lam = float(np.random.beta(self.cutmix_alpha, self.cutmix_alpha))
            H, W = x.shape[-2:]
            ch, cw = int(H * math.sqrt(1.0 - lam)), int(W * math.sqrt(1.0 - lam))
            cy, cx = np.random.randint(H), np.random.randint(W)
            y0, y1 = np.clip(cy - ch // 2, 0, H), np.clip(cy + ch // 2, 0, H)
            x0, x1 = np.clip(cx - cw // 2, 0, W), np.clip(cx + cw // 2, 0, W)
            x[..., y0:y1, x0:x1] = x.flip(0)[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / float(H * W)
        return x, self.one_hot(target, lam)


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


def drop_path(x, p, training):
    if p == 0.0 or not training:
        return x
    keep = torch.rand(x.size(0), 1, 1, device=x.device, dtype=x.dtype) >= p
    return x * keep / (1.0 - p)


class Attention(nn.Module):
    def __init__(self, dim, heads, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, mask=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if mask is not None:
            attn = attn.masked_fill(~mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class DividedSpaceTimeBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, drop_path=0.0):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm_t = nn.LayerNorm(dim, eps=1e-6)
        self.attn_t = Attention(dim, heads)
        self.temporal_fc = nn.Linear(dim, dim)
        self.norm_s = nn.LayerNorm(dim, eps=1e-6)
        self.attn_s = Attention(dim, heads)
        self.norm_mlp = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.drop_path = drop_path

    def forward(self, x, B, T, frame_mask):
        P = x.size(1) // T
        xt = x.reshape(B, T, P, -1).transpose(1, 2).reshape(B * P, T, -1)
        xt = self.temporal_fc(self.attn_t(self.norm_t(xt), frame_mask.repeat_interleave(P, dim=0)))
        x = x + drop_path(xt.reshape(B, P, T, -1).transpose(1, 2).reshape(B, T * P, -1), self.drop_path, self.training)
        xs = self.attn_s(self.norm_s(x.reshape(B * T, P, -1)))
        x = x + drop_path(xs.reshape(B, T * P, -1), self.drop_path, self.training)
        return x + drop_path(self.mlp(self.norm_mlp(x)), self.drop_path, self.training)


class TimeSformer(nn.Module):
    def __init__(self, img_size=224, patch=16, num_frames=8, dim=768, depth=12, heads=12,
                 num_classes=400, num_tags=64, drop_path_rate=0.1, head_drop=0.5):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        num_patches = (img_size // patch) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, dim))
        self.time_embed = nn.Parameter(torch.zeros(1, num_frames, 1, dim))
        dpr = [float(r) for r in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([DividedSpaceTimeBlock(dim, heads, drop_path=dpr[i]) for i in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head_drop = nn.Dropout(head_drop)
        self.head = nn.Linear(dim, num_classes)
        self.tag_head = nn.Linear(dim, num_tags)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, clips, frame_mask):
        B, T = clips.shape[:2]
        x = self.patch_embed(clips.flatten(0, 1)).flatten(2).transpose(1, 2) + self.pos_embed
        x = (x.reshape(B, T, -1, x.size(-1)) + self.time_embed[:, :T]).reshape(B, -1, x.size(-1))
        for blk in self.blocks:
            x = blk(x, B, T, frame_mask)
        x = self.norm(x)
        frame_feat = x.reshape(B, T, -1, x.size(-1)).mean(dim=2)
        valid = frame_mask.unsqueeze(-1).to(frame_feat.dtype)
        pooled = (frame_feat * valid).sum(dim=1) / valid.sum(dim=1).clamp(min=1.0)
        return self.head(self.head_drop(pooled)), self.tag_head(pooled)


def train_one_epoch(model, loader, criterion, optimizer, scaler, scheduler, mixup, epoch, args):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for it, (clips, frame_mask, labels, tags) in enumerate(loader):
        clips = normalize_clip(clips.cuda(non_blocking=True)).half()  # expect: AMP001
        frame_mask, labels, tags = frame_mask.cuda(), labels.cuda(), tags.cuda()
        clips, targets = mixup(clips, labels) if mixup is not None else (clips, labels)
        with torch.amp.autocast("cuda", enabled=args.amp):
            outputs, tag_logits = model(clips, frame_mask)
            aux_loss = F.binary_cross_entropy(torch.sigmoid(tag_logits), tags)  # expect: AMP003
        loss = criterion(outputs, targets) + args.aux_weight * aux_loss  # expect: AMP002
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise RuntimeError(f"Loss is {loss_value}, stopping training at epoch {epoch}")
        loss = loss / args.accum_iter
        scaler.scale(loss).backward()
        if (it + 1) % args.accum_iter == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if it % args.print_freq == 0:
            print(f"epoch {epoch} it {it} loss {loss_value:.4f} lr {optimizer.param_groups[0]['lr']:.2e}")


@torch.no_grad()
def evaluate(model, loader, args, num_views=3):
    model.eval()
    correct, total, nll = 0, 0, 0.0
    for clips, frame_mask, labels, _ in loader:
        clips = normalize_clip(clips.cuda(non_blocking=True))
        frame_mask, labels = frame_mask.cuda(), labels.cuda()
        probs = []
        with torch.amp.autocast("cuda", enabled=args.amp):
            for v in range(num_views):
                logits, _ = model(torch.roll(clips, shifts=8 * v, dims=-1), frame_mask)
                probs.append(logits.softmax(dim=-1))
            avg = torch.stack(probs).mean(dim=0)
            nll += F.nll_loss(torch.log(avg.clamp_min(1e-8)), labels, reduction="sum").item()
        correct += (avg.argmax(dim=-1) == labels).sum().item()
        total += labels.numel()
    return correct / max(total, 1), nll / max(total, 1)


def export_torchscript(model, path, num_frames, size):
    m = copy.deepcopy(model).eval().half()
    example = torch.randn(1, num_frames, 3, size, size, device="cuda", dtype=torch.float16)
    mask = torch.ones(1, num_frames, dtype=torch.bool, device="cuda")
    torch.jit.trace(m, (example, mask)).save(path)


def main(args):
    torch.manual_seed(args.seed)
    model = TimeSformer(num_frames=args.num_frames, num_classes=args.num_classes).cuda()
    if args.pure_half:
        model = model.half()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith("_embed")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or n.endswith("_embed")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)  # expect: AMP011
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009
    train_loader = DataLoader(ClipDataset(2000, args.num_frames), batch_size=args.batch_size, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(ClipDataset(200, args.num_frames), batch_size=args.batch_size, num_workers=4)
    steps = args.epochs * len(train_loader) // args.accum_iter
    warmup = args.warmup_epochs * len(train_loader) // args.accum_iter
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / max(1, warmup) if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))
    mixup = Mixup(num_classes=args.num_classes) if args.mixup else None
    criterion = SoftTargetCrossEntropy() if mixup is not None else nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, scheduler, mixup, epoch, args)
        acc, nll = evaluate(model, val_loader, args)
        print(f"epoch {epoch}: top1 {acc:.4f} nll {nll:.4f}")
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scaler": scaler.state_dict(), "epoch": epoch, "acc": acc}
        torch.save(state, os.path.join(args.output_dir, "last.pth"))
        if acc > best_acc:
            best_acc = acc
            torch.save(state, os.path.join(args.output_dir, "best.pth"))
    export_torchscript(model, os.path.join(args.output_dir, "timesformer_fp16.pt"), args.num_frames, 224)


def get_args():
    p = argparse.ArgumentParser("TimeSformer training")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum-iter", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--clip-grad", type=float, default=5.0)
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--num-classes", type=int, default=400)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--aux-weight", type=float, default=0.2)
    p.add_argument("--mixup", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--pure-half", action="store_true", help="store weights in fp16 (memory-saving mode)")
    p.add_argument("--print-freq", type=int, default=50)
    p.add_argument("--output-dir", default="./output")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    args = get_args()
    os.makedirs(args.output_dir, exist_ok=True)
    main(args)
