"""Perceiver IO for multi-label classification of irregular sensor streams.

Each sample is a set of (feature, position) tokens. A small latent array cross-attends
to the tokens, is refined by latent self-attention, and is read out by one learned
output query per class (Perceiver IO decoder).
"""
import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


@dataclass
class PerceiverConfig:
    input_dim: int = 32
    num_bands: int = 6
    num_latents: int = 64
    latent_dim: int = 256
    num_heads: int = 8
    num_self_layers: int = 6
    num_classes: int = 20
    ff_mult: int = 4
    dropout: float = 0.1
    lr: float = 3e-4
    weight_decay: float = 0.05
    epochs: int = 20
    accum_steps: int = 2
    clip: float = 1.0


@dataclass
class PerceiverOutput:
    logits: torch.Tensor
    log_probs: torch.Tensor
    summary: torch.Tensor


def fourier_features(pos, num_bands, max_freq=10.0):
    """Fourier encoding of scalar positions in [-1, 1]."""
    freqs = torch.linspace(1.0, max_freq / 2, num_bands, device=pos.device)
    ang = pos[..., None] * freqs * math.pi
    return torch.cat([pos[..., None], ang.sin(), ang.cos()], dim=-1)


def split_heads(t, heads):
    b, n, d = t.shape
    return t.view(b, n, heads, d // heads).transpose(1, 2)


def merge_heads(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def standardize(x):
    """Zero-mean / unit-variance over channels (projected inputs and output queries)."""
    mu = x.mean(dim=-1, keepdim=True)  # expect: AMP004
    sigma = x.std(dim=-1, keepdim=True)  # expect: AMP004
    return (x - mu) / (sigma + 1e-8)  # expect: AMP011


def pool_tokens(x):
    return x.mean(dim=1)


class FastLayerNorm(nn.Module):
    """LayerNorm written out by hand (kept from the JAX port for parity tests)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # expect: AMP004
        var = x.var(-1, keepdim=True, unbiased=False)  # expect: AMP004
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim * mult),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(dim * mult, dim),
        )
        self.post_norm = FastLayerNorm(dim)

    def forward(self, x):
        return self.post_norm(self.net(x))


class AttentionBase(nn.Module):
    """Multi-head attention; subclasses decide how padded tokens are masked."""

    def __init__(self, q_dim, kv_dim, heads, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (q_dim // heads) ** -0.5
        self.to_q = nn.Linear(q_dim, q_dim, bias=False)
        self.to_kv = nn.Linear(kv_dim, 2 * q_dim, bias=False)
        self.to_out = nn.Linear(q_dim, q_dim)
        self.attn_drop = nn.Dropout(dropout)
        self.register_buffer("last_entropy", torch.zeros(()), persistent=False)

    def _mask_scores(self, scores, mask):
        raise NotImplementedError

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        q = split_heads(self.to_q(x), self.heads)
        k, v = (split_heads(t, self.heads) for t in self.to_kv(context).chunk(2, dim=-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = self._mask_scores(scores, mask)
        attn = scores.softmax(dim=-1)
        if self.training:
            # logged by the trainer; softmax runs in fp32 under CUDA autocast
            ent = -(attn * torch.log(attn + 1e-8)).sum(-1).mean()
            self.last_entropy = ent.detach()
        out = torch.matmul(self.attn_drop(attn), v)
        return self.to_out(merge_heads(out))


class CrossAttention(AttentionBase):
    def _mask_scores(self, scores, mask):
        if mask is None:
            return scores
        return scores.masked_fill(~mask[:, None, None, :], -1e9)  # expect: AMP007


class SelfAttention(AttentionBase):
    def _mask_scores(self, scores, mask):
        if mask is None:
            return scores
        return scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)


class PerceiverEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        in_dim = cfg.input_dim + 2 * cfg.num_bands + 1
        self.num_bands = cfg.num_bands
        self.input_proj = nn.Linear(in_dim, cfg.latent_dim)
        self.latents = nn.Parameter(torch.randn(cfg.num_latents, cfg.latent_dim) * 0.02)
        self.norm_latents = nn.LayerNorm(cfg.latent_dim)
        self.norm_context = nn.LayerNorm(cfg.latent_dim)
        self.cross_attn = CrossAttention(cfg.latent_dim, cfg.latent_dim, heads=1, dropout=cfg.dropout)
        self.norm_ff = nn.LayerNorm(cfg.latent_dim)
        self.cross_ff = FeedForward(cfg.latent_dim, cfg.ff_mult, cfg.dropout)

    def forward(self, inputs, positions, mask=None):
        pos_enc = fourier_features(positions, self.num_bands)
        context = self.input_proj(torch.cat([inputs, pos_enc], dim=-1))
        context = standardize(context)
        latents = self.latents.expand(inputs.size(0), -1, -1)
        latents = latents + self.cross_attn(
            self.norm_latents(latents), context=self.norm_context(context), mask=mask
        )
        return latents + self.cross_ff(self.norm_ff(latents))


class LatentBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.latent_dim)
        self.attn = SelfAttention(cfg.latent_dim, cfg.latent_dim, cfg.num_heads, cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.latent_dim)
        self.ff = FeedForward(cfg.latent_dim, cfg.ff_mult, cfg.dropout)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class PerceiverDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(cfg.num_classes, cfg.latent_dim) * 0.02)
        self.query_proj = nn.Linear(cfg.latent_dim, cfg.latent_dim)
        self.norm = nn.LayerNorm(cfg.latent_dim)
        self.cross_attn = CrossAttention(cfg.latent_dim, cfg.latent_dim, cfg.num_heads, cfg.dropout)

    def forward(self, latents):
        q = self.query_proj(self.queries).expand(latents.size(0), -1, -1)
        q = standardize(q)
        return q + self.cross_attn(q, context=self.norm(latents))


class PerceiverIO(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = PerceiverEncoder(cfg)
        self.latent_blocks = nn.ModuleList([LatentBlock(cfg) for _ in range(cfg.num_self_layers)])
        self.final_norm = nn.LayerNorm(cfg.latent_dim)
        self.decoder = PerceiverDecoder(cfg)
        self.head = nn.Linear(cfg.latent_dim, 1)

    def forward(self, inputs, positions, mask=None):
        latents = self.encoder(inputs, positions, mask)
        for block in self.latent_blocks:
            latents = block(latents)
        latents = self.final_norm(latents)
        logits = self.head(self.decoder(latents)).squeeze(-1)
        log_probs = torch.log(torch.sigmoid(logits) + 1e-8)  # expect: AMP011
        return PerceiverOutput(logits=logits, log_probs=log_probs, summary=pool_tokens(latents))


def make_loader(cfg, n=2048, tokens=96, batch_size=32, shuffle=True):
    inputs = torch.randn(n, tokens, cfg.input_dim)
    positions = torch.rand(n, tokens) * 2 - 1
    mask = torch.rand(n, tokens) > 0.1
    targets = (torch.rand(n, cfg.num_classes) > 0.8).float()
    dataset = TensorDataset(inputs, positions, mask, targets)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle)


def train(model, loader, optimizer, scaler, cfg, device="cuda"):
    criterion = nn.BCEWithLogitsLoss()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (inputs, positions, mask, targets) in enumerate(loader):
        inputs = inputs.to(device, non_blocking=True)
        positions = positions.to(device, non_blocking=True)
        mask, targets = mask.to(device), targets.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(inputs, positions, mask)
            loss = criterion(out.logits, targets) / cfg.accum_steps
        scaler.scale(loss).backward()
        logit_drift = out.logits.detach().mean().item()  # expect: AMP004
        if (step + 1) % cfg.accum_steps == 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 1:
                acc = ((out.logits.detach() > 0) == targets.bool()).float().mean().item()
                print(f"step {step} loss {loss.item() * cfg.accum_steps:.4f} acc {acc:.3f} "
                      f"grad {grad_norm.item():.2f} drift {logit_drift:+.3f}")


@torch.no_grad()
def evaluate(model, loader, device="cuda"):
    model.eval()
    total_loss, total_nll, batches = 0.0, 0.0, 0
    for inputs, positions, mask, targets in loader:
        inputs, positions = inputs.to(device), positions.to(device)
        mask, targets = mask.to(device), targets.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(inputs, positions, mask)
            logit_spread = out.logits.std().item()
        total_loss += F.binary_cross_entropy_with_logits(out.logits.float(), targets).item()
        total_nll += -(targets * out.log_probs.float()).sum(-1).mean().item()
        batches += 1
    model.train()
    return {"bce": total_loss / batches, "nll": total_nll / batches, "spread": logit_spread}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()

    cfg = PerceiverConfig(epochs=args.epochs)
    device = "cuda"
    model = PerceiverIO(cfg).to(device)
    if args.compile:
        model = torch.compile(model)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
    )
    scaler = torch.amp.GradScaler("cuda")

    train_loader = make_loader(cfg)
    val_loader = make_loader(cfg, n=256, shuffle=False)
    for epoch in range(cfg.epochs):
        train(model, train_loader, optimizer, scaler, cfg, device)
        print(epoch, evaluate(model, val_loader, device))

    raw = model._orig_mod if hasattr(model, "_orig_mod") else model
    torch.save(raw.state_dict(), "perceiver_io.pt")


if __name__ == "__main__":
    main()
