"""Swin Transformer classifier (shifted windows, relative position bias, patch merging,
conv stem with channels-first LayerNorm), trained in bf16 autocast with mixup and EMA."""
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SwinConfig:
    img_size: int = 224
    patch: int = 4
    embed_dim: int = 96
    depths: tuple = (2, 2, 6, 2)
    heads: tuple = (3, 6, 12, 24)
    window: int = 7
    num_classes: int = 1000
    drop_path: float = 0.2
    mlp: str = "mlp"
    head_type: str = "linear"
    lr: float = 1e-3
    weight_decay: float = 0.05
    clip: float = 5.0
    compile: bool = True


def window_partition(x, ws):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)


def window_reverse(windows, ws, h, w):
    b = windows.shape[0] // ((h // ws) * (w // ws))
    x = windows.view(b, h // ws, w // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


def drop_path(x, p, training):
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


def relative_position_index(ws):
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += ws - 1
    rel[:, :, 1] += ws - 1
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1)


def shifted_window_mask(h, w, ws, shift):
    img_mask = torch.zeros((1, h, w, 1))
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img_mask[:, hs, wsl, :] = cnt
            cnt += 1
    mw = window_partition(img_mask, ws).squeeze(-1)
    mask = mw.unsqueeze(1) - mw.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


class LayerNorm2d(nn.Module):
    """channels-first LayerNorm (ConvNeXt style) for the convolutional stem."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvPatchEmbed(nn.Module):
    def __init__(self, in_ch, dim, patch):
        super().__init__()
        self.proj = nn.Conv2d(in_ch, dim, patch, patch)
        self.norm = LayerNorm2d(dim)

    def forward(self, x):
        x = self.norm(self.proj(x))
        return x.flatten(2).transpose(1, 2)


class WindowAttention(nn.Module):
    def __init__(self, dim, ws, heads, attn_drop=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(ws), persistent=False)
        self.attn_drop = nn.Dropout(attn_drop)
        self.logit_std = None

    def forward(self, x, mask=None):
        bw, n, c = x.shape
        qkv = self.qkv(x).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        logits = (q * self.scale) @ k.transpose(-2, -1)
        if self.training:
            self.logit_std = logits.detach().std()  # expect: AMP004
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = logits + bias.permute(2, 0, 1)[None]
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(bw // nw, nw, self.heads, n, n) + mask[None, :, None]
            attn = attn.view(-1, self.heads, n, n)
        attn = self.attn_drop(attn.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(bw, n, c))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class GRNMlp(Mlp):
    """MLP with ConvNeXt-V2 global response normalisation of the hidden units."""

    def __init__(self, dim, hidden):
        super().__init__(dim, hidden)
        self.gamma = nn.Parameter(torch.zeros(hidden))
        self.beta = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        h = self.act(self.fc1(x))
        gx = torch.norm(h, p=2, dim=1, keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.fc2(self.gamma * (h * nx) + self.beta + h)


MLPS = {"mlp": Mlp, "grn": GRNMlp}


class SwinBlock(nn.Module):
    def __init__(self, dim, res, heads, ws, shift, drop_path_rate=0.0, mlp="mlp"):
        super().__init__()
        self.res, self.ws, self.shift = res, ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPS[mlp](dim, 4 * dim)
        self.drop_path_rate = drop_path_rate
        mask = shifted_window_mask(res[0], res[1], ws, shift) if shift else None
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x):
        h, w = self.res
        b, l, c = x.shape
        shortcut = x
        x = self.norm1(x).view(b, h, w, c)
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), dims=(1, 2))
        x = window_reverse(self.attn(window_partition(x, self.ws), self.attn_mask), self.ws, h, w)
        if self.shift:
            x = torch.roll(x, (self.shift, self.shift), dims=(1, 2))
        x = shortcut + drop_path(x.reshape(b, l, c), self.drop_path_rate, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path_rate, self.training)


class PatchMerging(nn.Module):
    def __init__(self, res, dim):
        super().__init__()
        self.res = res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        h, w = self.res
        b, _, c = x.shape
        x = x.view(b, h, w, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.view(b, -1, 4 * c)))


class SwinTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.patch_embed = ConvPatchEmbed(3, cfg.embed_dim, cfg.patch)
        res, dim, k = cfg.img_size // cfg.patch, cfg.embed_dim, 0
        dpr = torch.linspace(0, cfg.drop_path, sum(cfg.depths)).tolist()
        self.stages = nn.ModuleList()
        for i, (depth, heads) in enumerate(zip(cfg.depths, cfg.heads)):
            ws = min(cfg.window, res)
            blocks = [
                SwinBlock(dim, (res, res), heads, ws, 0 if j % 2 == 0 or res <= ws else ws // 2,
                          drop_path_rate=dpr[k + j], mlp=cfg.mlp)
                for j in range(depth)
            ]
            k += depth
            if i < len(cfg.depths) - 1:
                blocks.append(PatchMerging((res, res), dim))
                dim, res = dim * 2, res // 2
            self.stages.append(nn.Sequential(*blocks))
        self.norm = nn.LayerNorm(dim)
        self.head_type = cfg.head_type
        self.head_proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, cfg.num_classes)

    def forward_features(self, x):
        x = self.patch_embed(x)
        for stage in self.stages:
            x = stage(x)
        return self.norm(x)

    def forward_head(self, x):
        x = x.mean(dim=1)
        if self.head_type == "std":
            f = self.head_proj(x)
            x = (f - f.mean(-1, keepdim=True)) / (f.std(-1, keepdim=True) + 1e-8)  # expect: AMP004
        return self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


def mixup(images, labels, num_classes, alpha=0.8, smoothing=0.1):
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    perm = torch.randperm(images.size(0), device=images.device)
    images = lam * images + (1 - lam) * images[perm]
    off = smoothing / num_classes
    y = torch.full((labels.size(0), num_classes), off, device=labels.device).scatter_(1, labels[:, None], 1.0 - smoothing + off)
    return images, lam * y + (1 - lam) * y[perm]


class Trainer:
    def __init__(self, model, cfg, device="cuda"):
        self.cfg = cfg
        self.device = device
        model = model.to(device)
        self.ema = copy.deepcopy(model).eval().requires_grad_(False)
        self.model = torch.compile(model) if cfg.compile else model
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            skip = p.ndim <= 1 or name.endswith("relative_position_bias_table")
            (no_decay if skip else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.999),
        )
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        self.criterion = SoftTargetCrossEntropy()

    def train_step(self, images, labels):
        images = images.to(self.device, non_blocking=True).to(memory_format=torch.channels_last)
        labels = labels.to(self.device, non_blocking=True)
        images, targets = mixup(images, labels, self.cfg.num_classes)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self.model(images)
            loss = self.criterion(logits, targets)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.update_ema()
        logit_std = logits.detach().float().std().item()
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), "logit_std": logit_std}

    @torch.no_grad()
    def update_ema(self, decay=0.9998):
        model = self.model._orig_mod if hasattr(self.model, "_orig_mod") else self.model
        for e, p in zip(self.ema.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(decay).add_(p.detach(), alpha=1 - decay)

    @torch.no_grad()
    def evaluate(self, loader):
        correct = total = 0
        for images, labels in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.ema(images.to(self.device))
            correct += (logits.argmax(-1).cpu() == labels).sum().item()
            total += labels.numel()
        return correct / total


def main(epochs=300, batch_size=128):
    cfg = SwinConfig(num_classes=100, head_type="std")
    model = SwinTransformer(cfg).to(memory_format=torch.channels_last)
    trainer = Trainer(model, cfg)
    data = torch.utils.data.TensorDataset(torch.randn(1024, 3, 224, 224), torch.randint(0, 100, (1024,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True)
    for epoch in range(epochs):
        for step, (x, y) in enumerate(loader):
            stats = trainer.train_step(x, y)
            if step % 50 == 0:
                print(epoch, step, stats)
        print("ema top-1", trainer.evaluate(loader))


if __name__ == "__main__":
    main()
