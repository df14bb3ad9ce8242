"""Text-conditioned latent diffusion transformer.

VAE latents (4x64x64) and T5 encoder states are precomputed by tools/cache_latents.py, so
training only runs the denoiser. Offset noise is renormalised to unit variance per sample.
"""
import argparse
import copy
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cached import CachedLatentTextDataset  # local module


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class CrossAttention(nn.Module):
    def __init__(self, dim, ctx_dim, heads=8):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(ctx_dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context, context_mask=None):
        b, n, d = x.shape
        h = self.heads
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, -1, h, d // h).transpose(1, 2).reshape(b * h, -1, d // h) for t in (q, k, v))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        if context_mask is not None:
            mask = context_mask.bool().repeat_interleave(h, dim=0)[:, None, :].expand_as(sim)
            sim[~mask] = -1e9  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b i j, b j d -> b i d", attn, v)
        return self.to_out(out.reshape(b, h, n, d // h).transpose(1, 2).reshape(b, n, d))


class DiTBlock(nn.Module):
    def __init__(self, dim, ctx_dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.xattn = CrossAttention(dim, ctx_dim, heads)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.ada[-1].weight)
        nn.init.zeros_(self.ada[-1].bias)

    def forward(self, x, c, ctx, ctx_mask):
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(c)[:, None].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + sc1) + sh1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        x = x + self.xattn(self.norm2(x), ctx, ctx_mask)
        h = self.norm3(x) * (1 + sc2) + sh2
        return x + g2 * self.mlp(h)


class TextDiT(nn.Module):
    def __init__(self, in_ch=4, size=64, patch=2, dim=768, depth=12, heads=12, ctx_dim=1024):
        super().__init__()
        self.patch, self.in_ch, self.size = patch, in_ch, size
        self.x_embed = nn.Conv2d(in_ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (size // patch) ** 2, dim))
        self.t_embed = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([DiTBlock(dim, ctx_dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.out = nn.Linear(dim, patch * patch * in_ch)

    def forward(self, x, t, ctx, ctx_mask):
        b = x.shape[0]
        x = self.x_embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t_embed(timestep_embedding(t, 256))
        for blk in self.blocks:
            x = blk(x, c, ctx, ctx_mask)
        x = self.out(self.norm(x))
        g, p = self.size // self.patch, self.patch
        x = x.reshape(b, g, g, p, p, self.in_ch).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, self.in_ch, self.size, self.size)


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--noise-offset", type=float, default=0.05)
    ap.add_argument("--cfg-drop", type=float, default=0.1)
    ap.add_argument("--ckpt-dir", default="ckpts/text_dit")
    args = ap.parse_args()

    device = torch.device("cuda")
    loader = DataLoader(CachedLatentTextDataset(args.cache_dir), batch_size=args.batch_size, shuffle=True,
                        num_workers=8, pin_memory=True, drop_last=True)
    model = TextDiT().to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0).float().to(device)
    sqrt_ab, sqrt_1m_ab = alphas_cumprod.sqrt(), (1.0 - alphas_cumprod).sqrt()
    os.makedirs(args.ckpt_dir, exist_ok=True)

    step = 0
    while step < args.steps:
        for batch in loader:
            latents = batch["latents"].type(torch.HalfTensor).to(device, non_blocking=True)  # expect: AMP001
            ctx = batch["text_states"].to(device, non_blocking=True)
            ctx_mask = batch["text_mask"].to(device, non_blocking=True)
            drop = torch.rand(ctx.shape[0], device=device) < args.cfg_drop
            ctx = ctx.masked_fill(drop[:, None, None], 0.0)

            b, c = latents.shape[:2]
            white = torch.randn(latents.shape, device=device, dtype=torch.float16)
            offset = torch.randn(b, c, 1, 1, device=device, dtype=torch.float16)
            noise = white + args.noise_offset * offset
            noise = noise / (noise.std(dim=(1, 2, 3), keepdim=True) + 1e-8)  # expect: AMP004 AMP011
            t = torch.randint(0, 1000, (b,), device=device)
            noisy = sqrt_ab[t].view(-1, 1, 1, 1) * latents + sqrt_1m_ab[t].view(-1, 1, 1, 1) * noise

            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                pred = model(noisy, t, ctx, ctx_mask)
                loss = F.mse_loss(pred.float(), noise.float())

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            update_ema(ema, model)
            step += 1

            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f}")
            if step % 10000 == 0:
                torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "step": step},
                           os.path.join(args.ckpt_dir, f"{step:07d}.pt"))
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
