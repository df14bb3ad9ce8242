"""Latent-diffusion UNet (diffusers / guided-diffusion layout) with its training objective.

Down blocks are chosen by name (``down_block_types``), cross-attention uses QK-RMSNorm,
``GaussianDiffusion.forward`` returns the loss, ``train`` runs fp16 autocast with a
GradScaler, ``finetune_with_prior_preservation`` is the DreamBooth-style loop.
"""
import copy
import math
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class UNetConfig:
    in_channels: int = 4
    block_out_channels: List[int] = field(default_factory=lambda: [128, 256, 512])
    down_block_types: List[str] = field(default_factory=lambda: ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"])
    layers_per_block: int = 2
    heads: int = 8
    context_dim: int = 768


@dataclass
class UNetOutput:
    sample: torch.Tensor


class SiLUFunction(torch.autograd.Function):
    """Memory-efficient SiLU: saves only the input, recomputes sigmoid in backward."""

    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad_output * s * (1 + x * (1 - s))


class MemoryEfficientSiLU(nn.Module):
    def forward(self, x):
        return SiLUFunction.apply(x)


class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


def normalization(channels):
    return GroupNorm32(32, channels)


def timestep_embedding(timesteps, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)  # expect: AMP004
        return self.scale * (x * torch.rsqrt(norm_x + self.eps))


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, temb_dim, dropout=0.0):
        super().__init__()
        self.in_layers = nn.Sequential(normalization(in_ch), MemoryEfficientSiLU(), nn.Conv2d(in_ch, out_ch, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(temb_dim, 2 * out_ch))
        self.out_norm = normalization(out_ch)
        self.out_layers = nn.Sequential(MemoryEfficientSiLU(), nn.Dropout(dropout), nn.Conv2d(out_ch, out_ch, 3, padding=1))
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, temb):
        h = self.in_layers(x)
        scale, shift = self.emb_layers(temb)[:, :, None, None].chunk(2, dim=1)
        h = self.out_layers(self.out_norm(h) * (1 + scale) + shift)
        return self.skip(x) + h


class AttentionBlock(nn.Module):
    def __init__(self, channels, heads=8, context_dim=None, qk_norm=True):
        super().__init__()
        self.heads, self.dim_head = heads, channels // heads
        self.norm = normalization(channels)
        self.to_q = nn.Linear(channels, channels, bias=False)
        self.to_k = nn.Linear(context_dim or channels, channels, bias=False)
        self.to_v = nn.Linear(context_dim or channels, channels, bias=False)
        self.q_norm = RMSNorm(self.dim_head) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.dim_head) if qk_norm else nn.Identity()
        self.to_out = nn.Linear(channels, channels)

    def forward(self, x, context=None, context_mask=None):
        B, C, H, W = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)
        ctx = h if context is None else context
        q = self.to_q(h).view(B, -1, self.heads, self.dim_head).transpose(1, 2)
        k = self.to_k(ctx).view(B, -1, self.heads, self.dim_head).transpose(1, 2)
        v = self.to_v(ctx).view(B, -1, self.heads, self.dim_head).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        attn_mask = None
        if context is not None and context_mask is not None:
            attn_mask = context_mask[:, None, None, :].bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = self.to_out(out.transpose(1, 2).reshape(B, H * W, C))
        return x + out.transpose(1, 2).reshape(B, C, H, W)


class DownBlock2D(nn.Module):
    def __init__(self, in_ch, out_ch, temb_dim, num_layers=2, add_downsample=True, **unused):
        super().__init__()
        self.resnets = nn.ModuleList([ResBlock(in_ch if i == 0 else out_ch, out_ch, temb_dim) for i in range(num_layers)])
        self.downsample = nn.Conv2d(out_ch, out_ch, 3, stride=2, padding=1) if add_downsample else None

    def forward(self, h, temb, context=None, context_mask=None):
        skips = []
        for resnet in self.resnets:
            h = resnet(h, temb)
            skips.append(h)
        if self.downsample is not None:
            h = self.downsample(h)
            skips.append(h)
        return h, skips


class CrossAttnDownBlock2D(DownBlock2D):
    def __init__(self, in_ch, out_ch, temb_dim, num_layers=2, add_downsample=True, heads=8, context_dim=None):
        super().__init__(in_ch, out_ch, temb_dim, num_layers, add_downsample)
        self.attentions = nn.ModuleList([AttentionBlock(out_ch, heads, context_dim) for _ in range(num_layers)])

    def forward(self, h, temb, context=None, context_mask=None):
        skips = []
        for resnet, attn in zip(self.resnets, self.attentions):
            h = attn(resnet(h, temb), context, context_mask)
            skips.append(h)
        if self.downsample is not None:
            h = self.downsample(h)
            skips.append(h)
        return h, skips


DOWN_BLOCKS = {"DownBlock2D": DownBlock2D, "CrossAttnDownBlock2D": CrossAttnDownBlock2D}


def get_down_block(block_type, **kwargs):
    return DOWN_BLOCKS[block_type](**kwargs)


class UNet2DModel(nn.Module):
    def __init__(self, cfg: UNetConfig):
        super().__init__()
        ch0, temb_dim = cfg.block_out_channels[0], cfg.block_out_channels[0] * 4
        self.cfg = cfg
        self.time_embed = nn.Sequential(nn.Linear(ch0, temb_dim), nn.SiLU(), nn.Linear(temb_dim, temb_dim))
        self.conv_in = nn.Conv2d(cfg.in_channels, ch0, 3, padding=1)
        chs, blocks = ch0, []
        for i, (btype, out_ch) in enumerate(zip(cfg.down_block_types, cfg.block_out_channels)):
            blocks.append(get_down_block(btype, in_ch=chs, out_ch=out_ch, temb_dim=temb_dim, num_layers=cfg.layers_per_block,
                                         add_downsample=i < len(cfg.block_out_channels) - 1, heads=cfg.heads,
                                         context_dim=cfg.context_dim))
            chs = out_ch
        self.down_blocks = nn.ModuleList(blocks)
        self.mid = nn.ModuleList([ResBlock(chs, chs, temb_dim), AttentionBlock(chs, cfg.heads, cfg.context_dim),
                                  ResBlock(chs, chs, temb_dim)])
        ups = []
        for out_ch in reversed(cfg.block_out_channels):
            ups.append(ResBlock(chs + out_ch, out_ch, temb_dim))
            chs = out_ch
        self.up_resnets = nn.ModuleList(ups)
        self.norm_out = normalization(chs)
        self.conv_out = nn.Conv2d(chs, cfg.in_channels, 3, padding=1)

    def forward(self, sample, timestep, context=None, context_mask=None) -> UNetOutput:
        temb = self.time_embed(timestep_embedding(timestep, self.cfg.block_out_channels[0]))
        h = self.conv_in(sample)
        pooled_skips = []
        for block in self.down_blocks:
            h, skips = block(h, temb, context, context_mask)
            pooled_skips.append(skips[-1])
        h = self.mid[0](h, temb)
        h = self.mid[1](h, context, context_mask)
        h = self.mid[2](h, temb)
        for resnet, skip in zip(self.up_resnets, reversed(pooled_skips)):
            h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = resnet(torch.cat([h, skip], dim=1), temb)
        h = F.interpolate(h, size=sample.shape[-2:], mode="nearest")
        return UNetOutput(sample=self.conv_out(F.silu(self.norm_out(h))))


class DiffusionOutput(NamedTuple):
    loss: torch.Tensor
    pred_std: torch.Tensor
    snr_weight: torch.Tensor


class GaussianDiffusion(nn.Module):
    def __init__(self, cfg: UNetConfig, num_timesteps=1000, prediction_type="epsilon", snr_gamma=5.0):
        super().__init__()
        self.unet = UNet2DModel(cfg)
        self.num_timesteps, self.prediction_type, self.snr_gamma = num_timesteps, prediction_type, snr_gamma
        betas = torch.linspace(1e-4, 0.02, num_timesteps, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.register_buffer("sqrt_ac", alphas_cumprod.sqrt().float())
        self.register_buffer("sqrt_1m_ac", (1.0 - alphas_cumprod).sqrt().float())
        self.register_buffer("snr", (alphas_cumprod / (1.0 - alphas_cumprod)).float())

    def forward(self, x0, context=None, context_mask=None) -> DiffusionOutput:
        b = x0.shape[0]
        t = torch.randint(0, self.num_timesteps, (b,), device=x0.device)
        noise = torch.randn_like(x0)
        a, s = self.sqrt_ac[t].view(b, 1, 1, 1), self.sqrt_1m_ac[t].view(b, 1, 1, 1)
        pred = self.unet(a * x0 + s * noise, t, context, context_mask).sample
        target = noise if self.prediction_type == "epsilon" else a * noise - s * x0
        per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        weight = torch.clamp(self.snr[t], max=self.snr_gamma) / self.snr[t]
        pred_std = pred.detach().std()  # expect: AMP004
        return DiffusionOutput(loss=(per_sample * weight).mean(), pred_std=pred_std, snr_weight=weight.mean())


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for pe, p in zip(ema_model.parameters(), model.parameters()):
        pe.lerp_(p, 1.0 - decay)


def train(cfg: UNetConfig, loader, steps, lr=1e-4, grad_clip=1.0, device="cuda"):
    diffusion = GaussianDiffusion(cfg).to(device)
    ema = copy.deepcopy(diffusion.unet).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(diffusion.unet.parameters(), lr=lr, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    for step, batch in zip(range(steps), loader):
        x0 = batch["latents"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = diffusion(x0, batch["context"].to(device), batch["mask"].to(device))
        scaler.scale(out.loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(diffusion.unet.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        ema_update(ema, diffusion.unet, 0.9999)
        if step % 100 == 0:
            print(f"step {step} loss {out.loss.item():.4f} pred_std {out.pred_std.item():.3f}")
    return diffusion, ema


def add_noise(latents, noise, t, num_timesteps=1000):
    ac = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, num_timesteps, device=latents.device), dim=0)[t]
    return ac.sqrt().view(-1, 1, 1, 1) * latents + (1.0 - ac).sqrt().view(-1, 1, 1, 1) * noise


def finetune_with_prior_preservation(unet, loader, optimizer, device, prior_weight=1.0):
    """DreamBooth: instance and class-prior images share one batch (instance half first)."""
    unet.train()
    for batch in loader:
        latents = batch["latents"].to(device)
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (latents.shape[0],), device=device)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            model_pred = unet(add_noise(latents, noise, t), t, batch["context"].to(device)).sample
        model_pred, model_pred_prior = model_pred.chunk(2)
        target, target_prior = noise.chunk(2)
        loss = F.mse_loss(model_pred, target)  # expect: AMP002
        prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float())
        (loss + prior_weight * prior_loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@torch.inference_mode()
def sample_ddim(unet, shape, context, uncond, steps=50, guidance=7.5, guidance_rescale=0.7, device="cuda"):
    ac = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, 1000, device=device), dim=0)
    x = torch.randn(shape, device=device)
    ts = torch.linspace(999, 0, steps, device=device).long()
    for i, t in enumerate(ts):
        with torch.autocast("cuda", dtype=torch.float16):
            t_batch = t.expand(2 * shape[0])
            eps_text, eps_uncond = unet(torch.cat([x, x]), t_batch, torch.cat([context, uncond])).sample.chunk(2)
            eps = eps_uncond + guidance * (eps_text - eps_uncond)
            std_text = eps_text.std(dim=(1, 2, 3), keepdim=True)
            std_cfg = eps.std(dim=(1, 2, 3), keepdim=True)
            eps = guidance_rescale * eps * (std_text / std_cfg) + (1 - guidance_rescale) * eps
        a_t = ac[t]
        a_prev = ac[ts[i + 1]] if i + 1 < len(ts) else torch.ones((), device=device)
        x0 = (x - (1 - a_t).sqrt() * eps.float()) / a_t.sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps.float()
    return x
