"""Perceiver IO for monocular depth with per-pixel Laplace uncertainty.

Inputs are flattened image patches of variable-size images (padded, with a
key mask); outputs are queried at arbitrary pixel coordinates.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def fourier_encode(coords, num_bands, max_freq=64.0):
    # coords in [-1, 1], shape (..., 2); returns (..., 2 * (2 * num_bands + 1))
    freqs = torch.linspace(1.0, max_freq / 2, num_bands, device=coords.device)
    scaled = coords.unsqueeze(-1) * freqs * math.pi
    enc = torch.cat([scaled.sin(), scaled.cos(), coords.unsqueeze(-1)], dim=-1)
    return enc.flatten(-2)


@dataclass
class DepthOutput:
    mu: torch.Tensor
    scale: torch.Tensor


class CrossAttention(nn.Module):
    def __init__(self, q_dim, kv_dim, heads=1, dim_head=64, standardize_keys=False):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.standardize_keys = standardize_keys
        self.norm_q = nn.LayerNorm(q_dim)
        self.norm_kv = nn.LayerNorm(kv_dim)
        self.to_q = nn.Linear(q_dim, inner, bias=False)
        self.to_k = nn.Linear(kv_dim, inner, bias=False)
        self.to_v = nn.Linear(kv_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, q_dim)

    def _split(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, -1).transpose(1, 2)

    def _standardize(self, k):
        # per-token key standardization: keeps logits bounded for long inputs
        k_mu = k.mean(dim=-1, keepdim=True)  # expect: AMP004
        k_sd = k.std(dim=-1, keepdim=True)  # expect: AMP004
        return (k - k_mu) / (k_sd + 1e-8)  # expect: AMP011

    def forward(self, x, context, mask=None):
        q = self._split(self.to_q(self.norm_q(x)))
        ctx = self.norm_kv(context)
        k = self.to_k(ctx)
        if self.standardize_keys:
            k = self._standardize(k)
        k, v = self._split(k), self._split(self.to_v(ctx))
        sim = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if mask is not None:
            sim = sim.masked_fill(~mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).flatten(2)
        return self.to_out(out)


class LatentBlock(nn.Module):
    def __init__(self, dim, heads=8, mlp_ratio=4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, z):
        b, n, d = z.shape
        qkv = self.qkv(self.norm1(z)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        z = z + self.proj(out.transpose(1, 2).reshape(b, n, d))
        return z + self.mlp(self.norm2(z))


class PerceiverIODepth(nn.Module):
    def __init__(self, patch=8, in_ch=3, num_latents=256, latent_dim=512, depth=6, num_bands=32):
        super().__init__()
        self.patch = patch
        self.num_bands = num_bands
        pos_dim = 2 * (2 * num_bands + 1)
        self.input_proj = nn.Linear(patch * patch * in_ch + pos_dim, latent_dim)
        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim) * 0.02)
        self.encode = CrossAttention(latent_dim, latent_dim, heads=1, dim_head=latent_dim, standardize_keys=True)
        self.blocks = nn.ModuleList([LatentBlock(latent_dim) for _ in range(depth)])
        self.query_proj = nn.Linear(pos_dim, latent_dim)
        self.decode = CrossAttention(latent_dim, latent_dim, heads=1, dim_head=latent_dim)
        self.depth_head = nn.Linear(latent_dim, 1)
        self.scale_head = nn.Linear(latent_dim, 1)

    def forward(self, patches, patch_coords, patch_mask, query_coords):
        tokens = self.input_proj(torch.cat([patches, fourier_encode(patch_coords, self.num_bands)], dim=-1))
        z = self.latents.unsqueeze(0).expand(tokens.size(0), -1, -1)
        z = z + self.encode(z, tokens, mask=patch_mask)
        for blk in self.blocks:
            z = blk(z)
        queries = self.query_proj(fourier_encode(query_coords, self.num_bands))
        out = self.decode(queries, z)
        mu = self.depth_head(out).squeeze(-1)
        scale = F.elu(self.scale_head(out).squeeze(-1)) + 1.0
        return DepthOutput(mu=mu, scale=scale)


def laplace_nll(mu, b, target, valid):
    log_b = torch.log(2.0 * b + 1e-8)  # expect: AMP011
    resid = (target - mu).abs() / (b + 1e-8)  # expect: AMP011
    nll = (log_b + resid) * valid
    return nll.sum() / valid.sum().clamp(min=1.0)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    abs_rel, n = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(batch["patches"], batch["patch_coords"], batch["patch_mask"], batch["query_coords"])
        err = (out.mu - batch["depth"]).abs() / batch["depth"].clamp(min=1e-3)
        abs_rel += (err * batch["valid"]).mean().item()
        n += 1
    model.train()
    return abs_rel / max(n, 1)


def train(args, train_loader, val_loader):
    device = torch.device("cuda")
    model = PerceiverIODepth(num_latents=args.num_latents, latent_dim=args.latent_dim).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader))
    scaler = torch.amp.GradScaler("cuda")
    step = 0
    for epoch in range(args.epochs):
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(batch["patches"], batch["patch_coords"], batch["patch_mask"], batch["query_coords"])
                loss = laplace_nll(out.mu, out.scale, batch["depth"], batch["valid"])
                # spread of confidence over the queried pixels (logged only)
                conf = torch.softmax(-out.scale.detach(), dim=-1)
                ent = -(conf * torch.log(conf + 1e-8)).sum(-1).mean()
            loss = scaler.scale(loss)
            loss.backward()
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                print(f"ep {epoch} step {step} nll {loss.item() / scaler.get_scale():.4f} ent {ent.item():.3f}")
        print(f"epoch {epoch}: val abs_rel {evaluate(model, val_loader, device):.4f}")
    return model
