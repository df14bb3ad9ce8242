"""A small latent-diffusion UNet and its training step (cross-attention on text tokens)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class CrossAttention(nn.Module):
    def __init__(self, dim, ctx_dim, heads=8):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(ctx_dim, dim * 2, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, context, context_mask=None):
        q = rearrange(self.q(x), "b n (h d) -> b h n d", h=self.heads)
        k, v = rearrange(self.kv(context), "b m (two h d) -> two b h m d", two=2, h=self.heads)
        sim = torch.einsum("bhnd,bhmd->bhnm", q, k) * q.shape[-1] ** -0.5
        if context_mask is not None:
            sim.masked_fill_(~context_mask[:, None, None, :], -1e5)  # expect: AMP007
        return self.out(rearrange(sim.softmax(-1) @ v, "b h n d -> b n (h d)"))


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(32, cin), nn.GroupNorm(32, cout)
        self.conv1, self.conv2 = nn.Conv2d(cin, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


def accumulate(loss, scaler, accum):
    scaler.scale(loss / accum).backward()


def train_step(unet, vae, text_encoder, batch, noise_sched, optimizer, scaler, accum=4):
    with torch.no_grad():
        latents = vae.encode(batch["image"]).latent_dist.sample() * 0.18215
        ctx = text_encoder(batch["ids"])[0]
    for i in range(accum):
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (latents.size(0),), device=latents.device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = unet(noise_sched.add_noise(latents, noise, t), t, ctx)
            loss = F.mse_loss(pred.float(), noise)
            accumulate(loss, scaler, accum)  # expect: AMP008
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def train_step_fixed(unet, batch, latents, ctx, noise_sched, optimizer, scaler, accum=4):
    for i in range(accum):
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (latents.size(0),), device=latents.device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = unet(noise_sched.add_noise(latents, noise, t), t, ctx)
            loss = F.mse_loss(pred.float(), noise)
        accumulate(loss, scaler, accum)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
