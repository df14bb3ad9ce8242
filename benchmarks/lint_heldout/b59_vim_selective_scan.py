"""Vision Mamba (Vim) with a bidirectional selective-scan mixer written in plain PyTorch,
a small convolutional stem, and DynamicViT-style token pruning.  ImageNet training
with bf16 autocast, mixup targets and an EMA of the weights.
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class FP32Softplus(torch.autograd.Function):
    """softplus for the step size, always in fp32 (dt underflows in low precision)."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.softplus(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)


def selective_scan(u, delta, A, B, C, D):
    """u, delta: (b, l, d); A: (d, n); B, C: (b, l, n); D: (d,).  Sequential reference scan."""
    b, l, d = u.shape
    deltaA = torch.exp(delta.unsqueeze(-1) * A)  # fp32: delta comes from FP32Softplus
    deltaB_u = delta.unsqueeze(-1) * B.unsqueeze(2) * u.unsqueeze(-1)
    h = torch.zeros(b, d, A.shape[1], device=u.device, dtype=deltaA.dtype)
    ys = []
    for i in range(l):
        h = deltaA[:, i] * h + deltaB_u[:, i]
        ys.append((h * C[:, i].unsqueeze(1)).sum(-1))
    y = torch.stack(ys, dim=1)
    return y + u * D


class MambaMixer(nn.Module):
    def __init__(self, d_model, d_state=16, expand=2, d_conv=4, dt_min=1e-3, dt_max=0.1):
        super().__init__()
        d_inner = expand * d_model
        self.d_state, self.dt_rank = d_state, math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv_f = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.conv_b = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        dt = torch.exp(torch.rand(d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=1e-4)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def _scan(self, xs, conv):
        L = xs.shape[1]
        xc = F.silu(conv(xs.transpose(1, 2))[..., :L]).transpose(1, 2)
        dt, B, C = self.x_proj(xc).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = FP32Softplus.apply(self.dt_proj(dt))
        A = -torch.exp(self.A_log.float())
        return selective_scan(xc, delta, A, B, C, self.D)

    def forward(self, x):
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        y_f = self._scan(xs, self.conv_f)
        y_b = self._scan(xs.flip(1), self.conv_b).flip(1)
        return self.out_proj((y_f + y_b) / 2 * F.silu(z))


class VimBlock(nn.Module):
    def __init__(self, dim, drop_path=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = MambaMixer(dim)
        self.drop_path = drop_path

    def forward(self, x):
        h = self.mixer(self.norm(x))
        if self.training and self.drop_path > 0:
            keep = torch.rand(x.shape[0], 1, 1, device=x.device) >= self.drop_path
            h = h * keep / (1 - self.drop_path)
        return x + h


class ConvStemSE(nn.Module):
    """Overlapping conv stem with squeeze-excitation, then patchify."""

    def __init__(self, in_ch, dim, patch=16):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, dim // 2, 3, 2, 1)
        self.se_fc1 = nn.Conv2d(dim // 2, dim // 8, 1)
        self.se_fc2 = nn.Conv2d(dim // 8, dim // 2, 1)
        self.proj = nn.Conv2d(dim // 2, dim, patch // 2, patch // 2)

    def forward(self, img):
        x = F.gelu(self.conv(img))
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        x = x * torch.sigmoid(self.se_fc2(F.relu(self.se_fc1(s))))
        return self.proj(x).flatten(2).transpose(1, 2)


class TokenScorer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim // 4)
        self.fc2 = nn.Linear(dim // 4, 1)

    def forward(self, x):
        return torch.sigmoid(self.fc2(F.gelu(self.fc1(x)))).squeeze(-1)


class VisionMamba(nn.Module):
    def __init__(self, dim=192, depth=24, num_classes=1000, img_size=224, prune_at=(8, 16), keep_ratio=0.7):
        super().__init__()
        self.stem = ConvStemSE(3, dim)
        n = (img_size // 16) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(1, n, dim))
        self.blocks = nn.ModuleList([VimBlock(dim, drop_path=0.1 * i / depth) for i in range(depth)])
        self.scorers = nn.ModuleDict({str(i): TokenScorer(dim) for i in prune_at})
        self.keep_ratio = keep_ratio
        self.norm_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, img):
        x = self.stem(img) + self.pos_embed
        ratio_loss = x.new_zeros(())
        start = 0
        for key, scorer in self.scorers.items():
            stop = int(key)
            for blk in self.blocks[start:stop]:
                x = blk(x)
            start = stop
            keep = scorer(x)
            ratio_loss = ratio_loss + (keep.mean(1) - self.keep_ratio).pow(2).mean()  # expect: AMP004
            # Gumbel-sigmoid in bf16: 1e-8 is representable (bf16 has fp32's range)
            logit = torch.log(keep + 1e-8) - torch.log(1 - keep + 1e-8)
            u = torch.rand_like(logit)
            hard = ((logit + torch.log(u) - torch.log1p(-u)) > 0).to(keep.dtype)
            order = torch.cumsum(hard, dim=1)  # cumsum runs in fp32 under CUDA autocast
            x = x * (hard + keep - keep.detach()).unsqueeze(-1) * (order > 0).unsqueeze(-1)
        for blk in self.blocks[start:]:
            x = blk(x)
        x = self.norm_f(x)
        return self.head(x.mean(1)), ratio_loss


def vim_tiny(**kw):
    return VisionMamba(dim=192, depth=24, **kw)


def vim_small(**kw):
    return VisionMamba(dim=384, depth=24, **kw)


MODELS = {"vim_tiny": vim_tiny, "vim_small": vim_small}


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


def mixup(img, target, num_classes, alpha=0.8, smoothing=0.1):
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    perm = torch.randperm(img.size(0), device=img.device)
    off, on = smoothing / num_classes, 1.0 - smoothing + smoothing / num_classes
    y = torch.full((img.size(0), num_classes), off, device=img.device).scatter_(1, target[:, None], on)
    return lam * img + (1 - lam) * img[perm], lam * y + (1 - lam) * y[perm]


@torch.no_grad()
def ema_update(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1 - decay)


def train(args):
    device = torch.device("cuda")
    model = MODELS[args.model](num_classes=args.num_classes).to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    criterion = SoftTargetCrossEntropy()
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith("pos_embed") or "A_log" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    loader = DataLoader(torch.load(args.data), batch_size=args.batch_size, shuffle=True, num_workers=10, drop_last=True)
    for epoch in range(args.epochs):
        model.train()
        for step, (img, target) in enumerate(loader):
            img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
            img, soft = mixup(img, target, args.num_classes)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, ratio_loss = model(img)
                loss = criterion(logits, soft) + 2.0 * ratio_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            ema_update(ema, model, 0.9996)
            if step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} ratio {ratio_loss.item():.4f}")
    return model, ema


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="vim_tiny", choices=sorted(MODELS))
    p.add_argument("--data", default="data/imagenet_train.pt")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    train(p.parse_args())
