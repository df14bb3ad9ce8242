"""Text-conditioned latent diffusion U-Net: timestep embeddings, GroupNorm res-blocks, cross-attention."""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class WeightStandardizedConv2d(nn.Conv2d):
    def forward(self, x):
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        weight = self.weight
        mean = weight.mean(dim=(1, 2, 3), keepdim=True)
        var = weight.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        weight = (weight - mean) * (var + eps).rsqrt()
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, emb_dim, groups=32, dropout=0.1):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch)
        self.conv1 = WeightStandardizedConv2d(in_ch, out_ch, 3, padding=1)
        self.emb_proj = nn.Linear(emb_dim, out_ch * 2)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb_proj(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(self.dropout(F.silu(h)))
        return self.skip(x) + h


class SpatialSelfAttention(nn.Module):
    """Multi-head self-attention over H*W positions with RMS-normalised queries and keys."""

    def __init__(self, channels, num_heads=4, groups=32):
        super().__init__()
        self.num_heads = num_heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.proj = nn.Conv1d(channels, channels, 1)
        self.temperature = nn.Parameter(torch.tensor(10.0))

    def _qk_norm(self, t):
        return t * torch.rsqrt((t * t).mean(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011

    def forward(self, x):
        B, C, H, W = x.shape
        qkv = self.qkv(self.norm(x).view(B, C, H * W))
        q, k, v = qkv.reshape(B, 3, self.num_heads, C // self.num_heads, H * W).unbind(1)
        q = self._qk_norm(q.transpose(-1, -2))
        k = self._qk_norm(k.transpose(-1, -2))
        attn = (q @ k.transpose(-1, -2)) * self.temperature
        attn = attn.softmax(dim=-1)
        out = (attn @ v.transpose(-1, -2)).transpose(-1, -2).reshape(B, C, H * W)
        return x + self.proj(out).view(B, C, H, W)


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim, heads=8, dim_head=64, groups=32):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.norm = nn.GroupNorm(groups, query_dim)
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context, context_mask=None):
        B, C, H, W = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)
        q, k, v = self.to_q(h), self.to_k(context), self.to_v(context)
        q, k, v = (t.view(B, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2) for t in (q, k, v))
        sim = (q @ k.transpose(-1, -2)) * self.scale
        if context_mask is not None:
            sim = sim.masked_fill(~context_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(B, H * W, -1)
        return x + self.to_out(out).transpose(1, 2).reshape(B, C, H, W)


class UNet(nn.Module):
    def __init__(self, in_ch=4, base=128, mults=(1, 2, 4), context_dim=768):
        super().__init__()
        self.base = base
        emb_dim = base * 4
        self.time_mlp = nn.Sequential(nn.Linear(base, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        self.conv_in = nn.Conv2d(in_ch, base, 3, padding=1)
        chs = [base * m for m in mults]
        self.down_res, self.down_xattn, self.downsample = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        ch, skip_chs = base, []
        for i, c in enumerate(chs):
            self.down_res.append(ResBlock(ch, c, emb_dim))
            self.down_xattn.append(CrossAttention(c, context_dim))
            ch = c
            skip_chs.append(ch)
            last = i == len(chs) - 1
            self.downsample.append(nn.Identity() if last else nn.Conv2d(ch, ch, 3, stride=2, padding=1))
        self.mid_res1 = ResBlock(ch, ch, emb_dim)
        self.mid_attn = SpatialSelfAttention(ch)
        self.mid_xattn = CrossAttention(ch, context_dim)
        self.mid_res2 = ResBlock(ch, ch, emb_dim)
        self.up_res, self.up_xattn, self.upsample = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for i in reversed(range(len(chs))):
            self.up_res.append(ResBlock(ch + skip_chs[i], chs[i], emb_dim))
            self.up_xattn.append(CrossAttention(chs[i], context_dim))
            ch = chs[i]
            self.upsample.append(nn.Upsample(scale_factor=2, mode="nearest") if i > 0 else nn.Identity())
        self.out_norm = nn.GroupNorm(32, ch)
        self.conv_out = nn.Conv2d(ch, in_ch, 3, padding=1)

    def forward(self, x, t, context, context_mask=None):
        emb = self.time_mlp(timestep_embedding(t, self.base))
        h = self.conv_in(x)
        skips = []
        for res, xattn, down in zip(self.down_res, self.down_xattn, self.downsample):
            h = xattn(res(h, emb), context, context_mask)
            skips.append(h)
            h = down(h)
        h = self.mid_res1(h, emb)
        h = self.mid_xattn(self.mid_attn(h), context, context_mask)
        h = self.mid_res2(h, emb)
        for res, xattn, up in zip(self.up_res, self.up_xattn, self.upsample):
            h = res(torch.cat([h, skips.pop()], dim=1), emb)
            h = up(xattn(h, context, context_mask))
        return self.conv_out(F.silu(self.out_norm(h)))


class TextEncoder(nn.Module):
    def __init__(self, vocab_size=49408, dim=768, depth=6, heads=12, max_len=77):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True, norm_first=True) for _ in range(depth)
        ])
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=~mask)
        return self.norm(x)


class GaussianDiffusion(nn.Module):
    def __init__(self, timesteps=1000):
        super().__init__()
        self.num_timesteps = timesteps
        betas = torch.linspace(1e-4, 0.02, timesteps, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.register_buffer("sqrt_ac", alphas_cumprod.sqrt().float())
        self.register_buffer("sqrt_1mac", (1.0 - alphas_cumprod).sqrt().float())
        self.register_buffer("snr", (alphas_cumprod / (1.0 - alphas_cumprod)).float())

    def q_sample(self, x0, t, noise):
        return self.sqrt_ac[t][:, None, None, None] * x0 + self.sqrt_1mac[t][:, None, None, None] * noise

    def min_snr_weight(self, t, gamma=5.0):
        snr = self.snr[t]
        return torch.clamp(snr, max=gamma) / snr


@torch.no_grad()
def update_ema(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1.0 - decay)


def train(loader, steps=200_000, lr=1e-4, ema_decay=0.9999, cfg_drop=0.1, device="cuda"):
    unet = UNet().to(device)
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    text_encoder = TextEncoder().to(device).half().eval().requires_grad_(False)
    diffusion = GaussianDiffusion().to(device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    step = 0
    while step < steps:
        for latents, ids, ids_mask in loader:
            latents = latents.to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
            ids, ids_mask = ids.to(device), ids_mask.to(device)
            with torch.no_grad():
                context = text_encoder(ids, ids_mask)
            keep = torch.rand(latents.shape[0], device=device) >= cfg_drop
            ids_mask = ids_mask & keep[:, None]
            t = torch.randint(0, diffusion.num_timesteps, (latents.shape[0],), device=device)
            noise = torch.randn_like(latents)
            x_t = diffusion.q_sample(latents, t, noise)
            with torch.autocast("cuda", dtype=torch.float16):
                noise_pred = unet(x_t, t, context, ids_mask)
                per_sample = F.mse_loss(noise_pred, noise, reduction="none").mean(dim=(1, 2, 3))
                loss = (per_sample * diffusion.min_snr_weight(t)).mean()
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            update_ema(ema, unet, ema_decay)
            step += 1
            if step % 1000 == 0:
                print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
            if step >= steps:
                break
    return ema
