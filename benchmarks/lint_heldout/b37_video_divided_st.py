"""Video classification with divided space-time attention (TimeSformer-style).

Each block attends over time (the same patch in every frame), then over space
(all patches of one frame), then applies an MLP.  Halfway through the stack a
saliency scorer keeps the most informative patches of each frame.

Training runs under CUDA bf16 autocast with gradient accumulation; the loop
takes its GradScaler from main().
"""
import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class VideoConfig:
    num_frames: int = 8
    img_size: int = 224
    patch: int = 16
    dim: int = 384
    depth: int = 8
    heads: int = 6
    num_classes: int = 174
    drop_path: float = 0.1
    keep_ratio: float = 0.7


class PatchEmbed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)

    def forward(self, video):  # [B, T, 3, H, W]
        b, t = video.shape[:2]
        x = self.proj(video.flatten(0, 1))  # [B*T, D, h, w]
        x = x.flatten(2).transpose(1, 2)  # [B*T, N, D]
        return x.reshape(b, t, x.size(1), x.size(2))


def drop_path(x, p, training):
    if p == 0.0 or not training:
        return x
    shape = (x.size(0),) + (1,) * (x.dim() - 1)
    keep = torch.rand(shape, device=x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # [B', L, D]
        b, l, d = x.shape
        qkv = self.qkv(x).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(b, l, d))


class DividedBlock(nn.Module):
    def __init__(self, dim, heads, drop_path_rate):
        super().__init__()
        self.norm_t = nn.LayerNorm(dim)
        self.attn_t = Attention(dim, heads)
        self.temporal_fc = nn.Linear(dim, dim)
        self.norm_s = nn.LayerNorm(dim)
        self.attn_s = Attention(dim, heads)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop_path_rate = drop_path_rate
        nn.init.zeros_(self.temporal_fc.weight)
        nn.init.zeros_(self.temporal_fc.bias)

    def _temporal(self, x):  # [B, T, N, D]
        b, t, n, d = x.shape
        xt = x.permute(0, 2, 1, 3).reshape(b * n, t, d)
        xt = self.temporal_fc(self.attn_t(self.norm_t(xt)))
        return xt.reshape(b, n, t, d).permute(0, 2, 1, 3)

    def _spatial(self, x):
        b, t, n, d = x.shape
        xs = self.attn_s(self.norm_s(x.reshape(b * t, n, d)))
        return xs.reshape(b, t, n, d)

    def forward(self, x):
        x = x + drop_path(self._temporal(x), self.drop_path_rate, self.training)
        x = x + drop_path(self._spatial(x), self.drop_path_rate, self.training)
        x = x + drop_path(self.mlp(self.norm_mlp(x)), self.drop_path_rate, self.training)
        return x


class TokenSaliency(nn.Module):
    """Scores the patch tokens of every frame and keeps the top fraction."""

    def __init__(self, dim, keep_ratio):
        super().__init__()
        self.score = nn.Sequential(nn.Linear(dim, dim // 4), nn.GELU(), nn.Linear(dim // 4, 1))
        self.keep_ratio = keep_ratio

    def forward(self, x):  # [B, T, N, D]
        b, t, n, d = x.shape
        s = self.score(x).squeeze(-1)  # [B, T, N]
        s_mu = s.mean(dim=-1, keepdim=True)  # expect: AMP004
        s_sd = s.std(dim=-1, keepdim=True)  # expect: AMP004
        s = (s - s_mu) / (s_sd + 1e-8)
        k = max(1, int(n * self.keep_ratio))
        idx = s.topk(k, dim=-1).indices
        kept = torch.gather(x, 2, idx.unsqueeze(-1).expand(-1, -1, -1, d))
        return kept, s


class DividedSTTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n_patches = (cfg.img_size // cfg.patch) ** 2
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Parameter(torch.zeros(1, 1, n_patches, cfg.dim))
        self.time_embed = nn.Parameter(torch.zeros(1, cfg.num_frames, 1, cfg.dim))
        dpr = [r.item() for r in torch.linspace(0, cfg.drop_path, cfg.depth)]
        self.blocks = nn.ModuleList(DividedBlock(cfg.dim, cfg.heads, dpr[i]) for i in range(cfg.depth))
        self.prune_at = cfg.depth // 2
        self.prune = TokenSaliency(cfg.dim, cfg.keep_ratio)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.time_embed, std=0.02)

    def forward_features(self, video):
        x = self.patch_embed(video) + self.pos_embed + self.time_embed
        saliency = None
        for i, blk in enumerate(self.blocks):
            if i == self.prune_at:
                x, saliency = self.prune(x)
            x = blk(x)
        x = self.norm(x)
        return x.mean(dim=(1, 2)), saliency

    def forward(self, video):
        feats, saliency = self.forward_features(video)
        return self.head(feats), saliency


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith("_embed"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(model, loader, optimizer, scaler, scheduler, epochs, accum_steps=2, clip=1.0):
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    model.train()
    for epoch in range(epochs):
        for it, (clips, labels) in enumerate(loader):
            clips = clips.to(device="cuda", dtype=torch.bfloat16, non_blocking=True)  # expect: AMP001
            labels = labels.cuda(non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits, saliency = model(clips)
                loss = criterion(logits, labels)
                sal_reg = saliency.float().pow(2).mean()
                loss = loss + 0.01 * sal_reg
            scaler.scale(loss / accum_steps).backward()
            if (it + 1) % accum_steps == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if it % 50 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")


@torch.no_grad()
def evaluate(model, loader, num_clips=3):
    model.eval()
    correct = total = 0
    for clips, labels in loader:  # clips: [B, K, T, 3, H, W]
        b = clips.size(0)
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            logits, _ = model(clips.flatten(0, 1).cuda())
        probs = logits.float().softmax(-1).view(b, num_clips, -1).mean(dim=1)
        correct += (probs.argmax(-1).cpu() == labels).sum().item()
        total += b
    model.train()
    return correct / max(total, 1)


def synthetic_loader(cfg, batches, batch_size, clips=1):
    for _ in range(batches):
        shape = (batch_size, cfg.num_frames, 3, cfg.img_size, cfg.img_size)
        if clips > 1:
            shape = (batch_size, clips) + shape[1:]
        yield torch.randn(shape), torch.randint(0, cfg.num_classes, (batch_size,))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accum-steps", type=int, default=4)
    args = parser.parse_args()

    cfg = VideoConfig()
    model = DividedSTTransformer(cfg)
    model.cuda()
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    steps = args.epochs * 100 // args.accum_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps + 1)
    for epoch in range(args.epochs):
        loader = synthetic_loader(cfg, 100, args.batch_size)
        train(model, loader, optimizer, scaler, scheduler, 1, accum_steps=args.accum_steps)
        acc = evaluate(model, synthetic_loader(cfg, 10, 2, clips=3), num_clips=3)
        print(f"epoch {epoch} top1 {acc:.3f}")
        torch.save(model.state_dict(), f"timesformer_ep{epoch}.pt")


if __name__ == "__main__":
    main()
