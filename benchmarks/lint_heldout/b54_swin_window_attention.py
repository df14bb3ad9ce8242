"""Hierarchical window-attention backbone (Swin v1 windows, Swin v2 cosine attention and a
linear-attention global stage), built from a config dict, trained timm-style with fp16 AMP."""
import argparse
import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader

CONFIGS = {
    "hybrid_tiny": dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7,
                        attn_types=("window", "window", "cosine", "linear"), mlp_ratio=4.0),
}


def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)


def window_reverse(windows, ws, H, W):
    x = windows.view(-1, H // ws, W // ws, ws, ws, windows.shape[-1])
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, H, W, windows.shape[-1])


def relative_position_index(ws):
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel += ws - 1
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1)


def build_shift_mask(H, W, ws, shift, device):
    img_mask = torch.zeros((1, H, W, 1), device=device)
    slices = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
    for cnt, (h, w) in enumerate(itertools.product(slices, slices)):
        img_mask[:, h, w, :] = cnt
    mask_windows = window_partition(img_mask, ws).squeeze(-1)
    attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    return attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)


class LayerNorm2d(nn.Module):
    """channels_first LayerNorm (ConvNeXt) used after the patchify stem."""
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


class BaseWindowAttention(nn.Module):
    def __init__(self, dim, num_heads, window_size, qkv_bias=True, attn_drop=0.0):
        super().__init__()
        self.num_heads, self.ws = num_heads, window_size
        self.head_dim, self.scale = dim // num_heads, (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)

    def _attend(self, q, k, v, mask, pad_mask):
        raise NotImplementedError

    def _add_shift_mask(self, attn, mask):
        nW, N = mask.shape[0], attn.shape[-1]
        attn = attn.view(-1, nW, self.num_heads, N, N) + mask[None, :, None]
        return attn.view(-1, self.num_heads, N, N)

    def forward(self, x, mask=None, pad_mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        x = self._attend(q, k, v, mask, pad_mask)
        return self.proj(x.transpose(1, 2).reshape(B_, N, C))


class WindowAttention(BaseWindowAttention):
    def __init__(self, dim, num_heads, window_size, **kw):
        super().__init__(dim, num_heads, window_size, **kw)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window_size - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window_size), persistent=False)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def _attend(self, q, k, v, mask, pad_mask):
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if pad_mask is not None:
            attn = attn.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        n = self.ws * self.ws
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            attn = self._add_shift_mask(attn, mask)
        attn = attn.softmax(dim=-1)
        self.attn_entropy = -(attn * torch.log(attn + 1e-8)).sum(-1).mean().detach()
        return self.attn_drop(attn) @ v


class CosineWindowAttention(BaseWindowAttention):
    def __init__(self, dim, num_heads, window_size, **kw):
        super().__init__(dim, num_heads, window_size, **kw)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((num_heads, 1, 1))))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, 512), nn.ReLU(inplace=True), nn.Linear(512, num_heads, bias=False))
        r = torch.arange(-(window_size - 1), window_size, dtype=torch.float32)
        table = torch.stack(torch.meshgrid(r, r, indexing="ij")).permute(1, 2, 0).unsqueeze(0) / (window_size - 1) * 8
        table = torch.sign(table) * torch.log2(torch.abs(table) + 1.0) / math.log2(8)
        self.register_buffer("relative_coords_table", table, persistent=False)
        self.register_buffer("relative_position_index", relative_position_index(window_size), persistent=False)

    def _attend(self, q, k, v, mask, pad_mask):
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        n = self.ws * self.ws
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = table[self.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        attn = attn + 16 * torch.sigmoid(bias).unsqueeze(0)
        if mask is not None:
            attn = self._add_shift_mask(attn, mask)
        if pad_mask is not None:
            attn = attn.masked_fill(pad_mask[:, None, None, :], torch.finfo(attn.dtype).min)
        return self.attn_drop(attn.softmax(dim=-1)) @ v


class LinearGlobalAttention(BaseWindowAttention):
    """Efficient-attention global mixing for the last, low-resolution stage."""
    def _attend(self, q, k, v, mask, pad_mask):
        q = F.elu(q) + 1.0
        k = F.elu(k) + 1.0
        kv = k.transpose(-2, -1) @ v
        z = 1.0 / (q @ k.sum(dim=-2, keepdim=True).transpose(-2, -1) + 1e-8)  # expect: AMP011
        return (q @ kv) * z


ATTENTION = {"window": WindowAttention, "cosine": CosineWindowAttention, "linear": LinearGlobalAttention}


class SwinBlock(nn.Module):
    def __init__(self, dim, num_heads, window_size, shift, attn_type, mlp_ratio):
        super().__init__()
        self.ws, self.shift, self.is_global = window_size, shift, attn_type == "linear"
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ATTENTION[attn_type](dim, num_heads, window_size)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def _window_attention(self, x, H, W):
        B, _, C = x.shape
        x = x.view(B, H, W, C)
        Hp, Wp = math.ceil(H / self.ws) * self.ws, math.ceil(W / self.ws) * self.ws
        pad_mask = None
        if Hp != H or Wp != W:
            x = F.pad(x, (0, 0, 0, Wp - W, 0, Hp - H))
            valid = torch.zeros(1, Hp, Wp, 1, dtype=torch.bool, device=x.device)
            valid[:, :H, :W] = True
            pad_mask = (~window_partition(valid, self.ws).squeeze(-1)).repeat(B, 1)
        mask = None
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
            mask = build_shift_mask(Hp, Wp, self.ws, self.shift, x.device)
        windows = self.attn(window_partition(x, self.ws), mask=mask, pad_mask=pad_mask)
        x = window_reverse(windows, self.ws, Hp, Wp)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        return x[:, :H, :W].reshape(B, H * W, C)

    def forward(self, x, H, W):
        h = self.norm1(x)
        x = x + (self.attn(h) if self.is_global else self._window_attention(h, H, W))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x, H, W):
        B, _, C = x.shape
        x = x.view(B, H, W, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C))), H // 2, W // 2


class SwinStage(nn.Module):
    def __init__(self, in_dim, depth, num_heads, window_size, attn_type, mlp_ratio, downsample):
        super().__init__()
        self.downsample = PatchMerging(in_dim) if downsample else None
        dim = in_dim * 2 if downsample else in_dim
        self.blocks = nn.ModuleList([
            SwinBlock(dim, num_heads, window_size, 0 if (i % 2 == 0 or attn_type == "linear") else window_size // 2,
                      attn_type, mlp_ratio)
            for i in range(depth)
        ])

    def forward(self, x, H, W):
        if self.downsample is not None:
            x, H, W = self.downsample(x, H, W)
        for blk in self.blocks:
            x = blk(x, H, W)
        return x, H, W


class HybridSwin(nn.Module):
    def __init__(self, cfg, num_classes=1000, in_chans=3, aux_stages=(1, 2)):
        super().__init__()
        d = cfg["embed_dim"]
        self.stem = nn.Sequential(nn.Conv2d(in_chans, d, 4, 4), LayerNorm2d(d))
        self.stages = nn.ModuleList([
            SwinStage(d * 2 ** max(i - 1, 0), depth, cfg["num_heads"][i], cfg["window_size"], cfg["attn_types"][i],
                      cfg["mlp_ratio"], downsample=i > 0)
            for i, depth in enumerate(cfg["depths"])
        ])
        self.aux_heads = nn.ModuleDict({str(i): nn.Linear(d * 2 ** i, num_classes) for i in aux_stages})
        self.norm = nn.LayerNorm(d * 2 ** (len(cfg["depths"]) - 1))
        self.head = nn.Linear(d * 2 ** (len(cfg["depths"]) - 1), num_classes)

    def forward(self, images):
        x = self.stem(images)
        H, W = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        feats = []
        for stage in self.stages:
            x, H, W = stage(x, H, W)
            feats.append(x)
        aux_logits = [head(feats[int(name)]).mean(dim=1) for name, head in self.aux_heads.items()]  # expect: AMP004
        x = self.norm(x)
        return self.head(x.mean(dim=1)), aux_logits


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


def param_groups(model, weight_decay, skip=("relative_position", "logit_scale", "cpb_mlp")):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or any(k in n for k in skip) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_one_epoch(model, loader, optimizer, scaler, criterion, args, num_classes):
    model.train()
    for step, (images, targets) in enumerate(loader):
        images, targets = images.cuda(non_blocking=True), targets.cuda(non_blocking=True)
        soft_targets = F.one_hot(targets, num_classes).float() * 0.9 + 0.1 / num_classes
        with torch.autocast("cuda", dtype=torch.float16):
            logits, aux_logits = model(images)
            loss = criterion(logits, soft_targets)
        aux_loss = sum(F.cross_entropy(a, targets, label_smoothing=0.1) for a in aux_logits)  # expect: AMP002
        loss = loss + args.aux_weight * aux_loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        if step % args.log_interval == 0:
            print(f"step {step} loss {loss.item():.4f} grad_norm {grad_norm:.3f} scale {scaler.get_scale():.0f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="hybrid_tiny", choices=list(CONFIGS))
    parser.add_argument("--data", default="./imagenet")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    args.epochs, args.lr, args.aux_weight, args.clip_grad, args.log_interval = 300, 1e-3, 0.3, 5.0, 50

    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_set = torchvision.datasets.ImageFolder(f"{args.data}/train", tf)
    loader = DataLoader(train_set, batch_size=128, shuffle=True, num_workers=8, drop_last=True)

    num_classes = len(train_set.classes)
    model = HybridSwin(CONFIGS[args.arch], num_classes=num_classes).cuda()
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cuda")
    criterion = SoftTargetCrossEntropy()
    for epoch in range(args.epochs):
        train_one_epoch(model, loader, optimizer, scaler, criterion, args, num_classes)
        torch.save({"model": model.state_dict(), "epoch": epoch}, f"swin_hybrid_{epoch}.pth")


if __name__ == "__main__":
    main()
