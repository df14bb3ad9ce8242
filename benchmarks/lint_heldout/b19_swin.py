"""Swin Transformer (shifted-window attention, relative position bias) for ImageNet-style training."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def window_partition(x, window_size):
    B, H, W, C = x.shape
    x = x.view(B, H // window_size, window_size, W // window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)


def window_reverse(windows, window_size, H, W):
    B = int(windows.shape[0] / (H * W / window_size / window_size))
    x = windows.view(B, H // window_size, W // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


def build_shift_mask(H, W, window_size, shift_size):
    """Boolean mask (nW, N, N): True where two tokens of a window come from different regions."""
    img_mask = torch.zeros((1, H, W, 1))
    cnt = 0
    slices = (slice(0, -window_size), slice(-window_size, -shift_size), slice(-shift_size, None))
    for h in slices:
        for w in slices:
            img_mask[:, h, w, :] = cnt
            cnt += 1
    mask_windows = window_partition(img_mask, window_size).view(-1, window_size * window_size)
    return (mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)) != 0


class DropPath(nn.Module):
    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = x.new_empty(shape).bernoulli_(keep_prob)
        return x.div(keep_prob) * mask


class Mlp(nn.Module):
    def __init__(self, dim, hidden, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class PatchEmbed(nn.Module):
    """Conv patchify; optionally standardise every patch embedding instead of a LayerNorm."""

    def __init__(self, in_chans=3, embed_dim=96, patch_size=4, standardize=False):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.standardize = standardize
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x):
        x = self.proj(x).flatten(2).transpose(1, 2)
        if self.standardize:
            mu = x.mean(dim=-1, keepdim=True)  # expect: AMP004
            sigma = x.std(dim=-1, keepdim=True)  # expect: AMP004
            return (x - mu) / (sigma + 1e-8)  # expect: AMP011
        return self.norm(x)


class WindowAttention(nn.Module):
    def __init__(self, dim, window_size, num_heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        num_rel = (2 * window_size - 1) * (2 * window_size - 1)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(num_rel, num_heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window_size), torch.arange(window_size), indexing="ij"))
        coords_flatten = torch.flatten(coords, 1)
        rel = (coords_flatten[:, :, None] - coords_flatten[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += window_size - 1
        rel[:, :, 1] += window_size - 1
        rel[:, :, 0] *= 2 * window_size - 1
        self.register_buffer("relative_position_index", rel.sum(-1), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def _relative_bias(self):
        n = self.window_size * self.window_size
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, -1).permute(2, 0, 1).contiguous()

    def forward(self, x, mask=None, key_padding_mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N)
            attn = attn.masked_fill(mask[None, :, None, :, :], -1e9)  # expect: AMP007
            attn = attn.view(-1, self.num_heads, N, N)
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], torch.finfo(attn.dtype).min)
        attn = attn + self._relative_bias().unsqueeze(0)
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj_drop(self.proj(x))


class SwinBlock(nn.Module):
    def __init__(self, dim, resolution, num_heads, window_size=7, shift_size=0, mlp_ratio=4.0, drop_path=0.0):
        super().__init__()
        self.resolution = resolution
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window_size, num_heads)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        if shift_size > 0:
            H, W = resolution
            self.register_buffer("attn_mask", build_shift_mask(H, W, window_size, shift_size), persistent=False)
        else:
            self.attn_mask = None

    def forward(self, x):
        H, W = self.resolution
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        windows = window_partition(x, self.window_size).view(-1, self.window_size * self.window_size, C)
        windows = self.attn(windows, mask=self.attn_mask)
        x = window_reverse(windows.view(-1, self.window_size, self.window_size, C), self.window_size, H, W)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        x = shortcut + self.drop_path(x.reshape(B, H * W, C))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    def __init__(self, resolution, dim):
        super().__init__()
        self.resolution = resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        H, W = self.resolution
        B, L, C = x.shape
        x = x.view(B, H, W, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class SwinTransformer(nn.Module):
    def __init__(self, img_size=224, num_classes=1000, embed_dim=96, depths=(2, 2, 6, 2),
                 num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=0.1, standardize_patches=True):
        super().__init__()
        self.patch_embed = PatchEmbed(embed_dim=embed_dim, standardize=standardize_patches)
        res = img_size // 4
        dpr = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        self.blocks = nn.ModuleList()
        self.merges = nn.ModuleList()
        dim, idx = embed_dim, 0
        for i, depth in enumerate(depths):
            stage = nn.ModuleList([
                SwinBlock(dim, (res, res), num_heads[i], window_size,
                          0 if j % 2 == 0 else window_size // 2, drop_path=dpr[idx + j])
                for j in range(depth)
            ])
            self.blocks.append(stage)
            idx += depth
            if i < len(depths) - 1:
                self.merges.append(PatchMerging((res, res), dim))
                dim, res = dim * 2, res // 2
        self.num_features = dim
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        for i, stage in enumerate(self.blocks):
            for blk in stage:
                x = blk(x)
            if i < len(self.merges):
                x = self.merges[i](x)
        x = self.norm(x).mean(dim=1)
        return self.head(x)


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, logits, target):
        loss = torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1)
        return loss.mean()


def mixup(images, targets, num_classes, alpha=0.8, smoothing=0.1):
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    off = smoothing / num_classes
    one_hot = torch.full((targets.size(0), num_classes), off, device=targets.device)
    one_hot.scatter_(1, targets[:, None], 1.0 - smoothing + off)
    mixed = images.mul(lam).add_(images.flip(0), alpha=1.0 - lam)
    return mixed, one_hot.mul(lam).add_(one_hot.flip(0), alpha=1.0 - lam)


def cosine_lr(step, total, base_lr, warmup):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, seen = 0, 0
    for images, targets in loader:
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(images.to(device))
        correct += (logits.argmax(-1) == targets.to(device)).sum().item()
        seen += targets.numel()
    return correct / max(1, seen)


def train(train_loader, val_loader, num_classes=1000, epochs=300, base_lr=1e-3, clip_grad=5.0):
    device = torch.device("cuda")
    model = SwinTransformer(num_classes=num_classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    criterion = SoftTargetCrossEntropy()
    total = epochs * len(train_loader)
    best_acc, step = 0.0, 0
    for epoch in range(epochs):
        model.train()
        for images, targets in train_loader:
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, total, base_lr, warmup=20 * len(train_loader))
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            images, soft_targets = mixup(images, targets, num_classes)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                logits = model(images)
                loss = criterion(logits, soft_targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            step += 1
        acc = evaluate(model, val_loader, device)
        if acc > best_acc:
            best_acc = acc
            torch.save(model.state_dict(), "swin_best.pt")
    return best_acc
