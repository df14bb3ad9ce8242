"""Bidirectional Hyena vision backbone: implicit long convolutions (FFT) over patch tokens."""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def fftconv_ref(u, k, bias):
    seqlen = u.shape[-1]
    fft_size = 2 * seqlen
    k_f = torch.fft.rfft(k, n=fft_size) / fft_size
    u_f = torch.fft.rfft(u, n=fft_size)
    y = torch.fft.irfft(u_f * k_f, n=fft_size, norm="forward")[..., :seqlen]
    return y + u * bias.unsqueeze(-1)


class FFTConv(torch.autograd.Function):
    """cuFFT only takes half precision for power-of-two sizes, so this runs in fp32."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, u, k, bias):
        ctx.save_for_backward(u, k, bias)
        return fftconv_ref(u, k, bias)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        u, k, bias = ctx.saved_tensors
        with torch.enable_grad():
            u_, k_, b_ = (t.detach().requires_grad_() for t in (u, k, bias))
            y = fftconv_ref(u_, k_, b_)
        return torch.autograd.grad(y, (u_, k_, b_), grad_out)


class Sin(nn.Module):
    def __init__(self, dim, w=10.0):
        super().__init__()
        self.freq = nn.Parameter(w * torch.ones(1, dim))

    def forward(self, x):
        return torch.sin(self.freq * x)


def positional_features(emb_dim, max_len):
    t = torch.linspace(0, 1, max_len)[None, :, None]
    bands = (emb_dim - 1) // 2
    w = 2 * math.pi * torch.linspace(0, max_len - 1, max_len)[None, :, None] / max_len
    z = torch.exp(-1j * torch.linspace(1e-4, bands - 1, bands)[None, None] * w)
    return torch.cat([t, z.real, z.imag], dim=-1), t


class HyenaFilter(nn.Module):
    def __init__(self, d_model, max_len, emb_dim=33, order=64):
        super().__init__()
        z, t = positional_features(emb_dim, max_len)
        self.register_buffer("z", z)
        self.register_buffer("t", t)
        self.implicit = nn.Sequential(
            nn.Linear(emb_dim, order), Sin(order),
            nn.Linear(order, order), Sin(order),
            nn.Linear(order, d_model, bias=False),
        )
        max_decay, min_decay = math.log(1e-2) / 0.3, math.log(1e-2) / 1.5
        self.register_buffer("deltas", torch.linspace(min_decay, max_decay, d_model)[None, None])
        self.bias = nn.Parameter(torch.randn(d_model))

    def forward(self, length):
        z, t = self.z[:, :length], self.t[:, :length]
        k = self.implicit(z) * torch.exp(-t * self.deltas.abs())
        return k[0].transpose(0, 1), self.bias


class PatchEmbed(nn.Module):
    """Conv patchifier followed by a parameter-free per-token standardisation."""

    def __init__(self, img_size=224, patch=16, in_chans=3, dim=384):
        super().__init__()
        self.num_patches = (img_size // patch) ** 2
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        x = self.proj(x).flatten(2).transpose(1, 2)
        mu = x.mean(dim=-1, keepdim=True)  # expect: AMP004
        sigma = x.std(dim=-1, keepdim=True)  # expect: AMP004
        return (x - mu) / (sigma + 1e-8)  # expect: AMP011


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class TokenGate(nn.Module):
    """Squeeze-excite over the sequence axis: a global context vector gates the channels."""

    def __init__(self, dim, rd_ratio=0.25):
        super().__init__()
        rd = max(16, int(dim * rd_ratio))
        self.fc1 = nn.Linear(dim, rd)
        self.fc2 = nn.Linear(rd, dim)

    def forward(self, x):
        pooled = x.mean(dim=1, keepdim=True)  # expect: AMP004
        return x * torch.sigmoid(self.fc2(F.gelu(self.fc1(pooled))))


class HyenaOperator(nn.Module):
    def __init__(self, d_model, max_len, order=2, short_kernel=3, dropout=0.0):
        super().__init__()
        self.d_model = d_model
        self.order = order
        inner = d_model * (order + 1)
        self.in_proj = nn.Linear(d_model, inner)
        self.short_filter = nn.Conv1d(inner, inner, short_kernel, padding=short_kernel - 1, groups=inner)
        self.filter_fn = HyenaFilter(d_model * (order - 1), max_len)
        self.out_proj = nn.Linear(d_model, d_model)
        self.gate = TokenGate(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, u):
        L = u.size(1)
        uc = self.short_filter(self.in_proj(u).transpose(1, 2))[..., :L]
        *x, v = uc.split(self.d_model, dim=1)
        k, bias = self.filter_fn(L)
        k = k.view(self.order - 1, self.d_model, L)
        bias = bias.view(self.order - 1, self.d_model)
        for o, x_i in enumerate(reversed(x[1:])):
            v = self.dropout(v * x_i)
            v = FFTConv.apply(v, k[o], bias[o])
        y = (v * x[0]).transpose(1, 2)
        return self.gate(self.out_proj(y))


class HyenaBlock(nn.Module):
    def __init__(self, dim, max_len, mlp_ratio=4.0, drop=0.0):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.mixer_fwd = HyenaOperator(dim, max_len)
        self.mixer_bwd = HyenaOperator(dim, max_len)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.drop(self.mixer_fwd(h) + self.mixer_bwd(h.flip(1)).flip(1))
        return x + self.drop(self.mlp(self.norm2(x)))


class VimHyena(nn.Module):
    def __init__(self, img_size=224, patch=16, dim=384, depth=12, num_classes=1000, drop=0.0):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch, 3, dim)
        n = self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, n, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList([HyenaBlock(dim, n, drop=drop) for _ in range(depth)])
        self.norm_f = RMSNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward_features(self, img):
        x = self.patch_embed(img) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm_f(x)

    def forward(self, img):
        x = self.forward_features(img)
        return self.head(x.mean(dim=1))


def build_loaders(args):
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(args.img_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(int(args.img_size * 1.14)), transforms.CenterCrop(args.img_size), transforms.ToTensor(), norm])
    train_ds, val_ds = datasets.ImageFolder(f"{args.data}/train", train_tf), datasets.ImageFolder(f"{args.data}/val", val_tf)
    return (DataLoader(train_ds, args.batch_size, shuffle=True, num_workers=8, pin_memory=True, drop_last=True),
            DataLoader(val_ds, args.batch_size, num_workers=8, pin_memory=True))


@torch.inference_mode()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images.to(device, non_blocking=True))
        correct += (logits.argmax(-1).cpu() == targets).sum().item()
        total += targets.numel()
    return correct / max(total, 1)


def export_half(model, path):
    torch.save(copy.deepcopy(model).half().state_dict(), path)


def train(args):
    device = torch.device("cuda")
    model = VimHyena(args.img_size, dim=args.dim, depth=args.depth, num_classes=args.num_classes).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    groups = [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cuda")
    train_loader, val_loader = build_loaders(args)
    total = args.epochs * (len(train_loader) // args.accum_steps)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.05)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images)
                loss = F.cross_entropy(logits, targets, label_smoothing=args.smoothing)
            scaled = scaler.scale(loss / args.accum_steps)
            scaled.backward()
            if (i + 1) % args.accum_steps != 0:
                continue
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()  # expect: AMP006
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            sched.step()
            if i % 100 == 0:
                print(f"epoch {epoch} it {i} loss {loss.item():.4f} gnorm {grad_norm.item():.2f}")
        acc = evaluate(model, val_loader, device)
        if acc > best:
            best = acc
            export_half(model, f"{args.out}/vim_hyena_best_fp16.pt")
        print(f"epoch {epoch}: top1 {acc:.4f} (best {best:.4f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default=".")
    defaults = {"img_size": 224, "dim": 384, "depth": 12, "num_classes": 1000, "batch_size": 128,
                "accum_steps": 2, "epochs": 300, "lr": 1e-3, "wd": 0.05, "clip": 1.0, "smoothing": 0.1}
    for name, value in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    train(p.parse_args())
