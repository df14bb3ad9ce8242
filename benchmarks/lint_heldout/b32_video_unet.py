"""Latent video diffusion: a factorised space-time UNet and its trainer.

Spatial 1x3x3 and temporal 3x1x1 convolutions, temporal self-attention over
frames at the low resolutions, epsilon prediction with min-SNR weighting.
Latents come from a frozen image VAE applied frame by frame.
"""
import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKL
from torch.nn.parallel import DistributedDataParallel as DDP


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class FrameGate(nn.Module):
    """Squeeze over space, excite per frame and channel."""

    def __init__(self, ch, reduction=8):
        super().__init__()
        self.fc1 = nn.Linear(ch, ch // reduction)
        self.fc2 = nn.Linear(ch // reduction, ch)

    def forward(self, h):
        s = h.mean(dim=(3, 4)).transpose(1, 2)  # expect: AMP004
        s = s / (s.abs().amax(dim=-1, keepdim=True) + 1e-8)
        s = torch.sigmoid(self.fc2(F.silu(self.fc1(s))))
        return h * s.transpose(1, 2)[..., None, None]


class ResBlock3D(nn.Module):
    def __init__(self, in_ch, out_ch, temb_dim, dropout=0.0, frame_gate=False):
        super().__init__()
        self.norm1 = GroupNorm32(32, in_ch)
        self.conv1 = nn.Conv3d(in_ch, out_ch, (1, 3, 3), padding=(0, 1, 1))
        self.temb_proj = nn.Linear(temb_dim, 2 * out_ch)
        self.norm2 = GroupNorm32(32, out_ch)
        self.conv2 = nn.Conv3d(out_ch, out_ch, (3, 1, 1), padding=(1, 0, 0))
        self.skip = nn.Conv3d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()
        self.gate = FrameGate(out_ch) if frame_gate else nn.Identity()
        self.dropout = dropout

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.temb_proj(F.silu(temb))[:, :, None, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(F.dropout(F.silu(h), self.dropout, self.training))
        return self.skip(x) + self.gate(h)


class TemporalAttention(nn.Module):
    def __init__(self, ch, heads=8):
        super().__init__()
        self.norm = GroupNorm32(32, ch)
        self.qkv = nn.Linear(ch, 3 * ch)
        self.proj = nn.Linear(ch, ch)
        self.heads = heads

    def forward(self, x, frame_mask=None):
        b, c, t, hh, ww = x.shape
        seq = self.norm(x).permute(0, 3, 4, 2, 1).reshape(b * hh * ww, t, c)
        qkv = self.qkv(seq).reshape(b * hh * ww, t, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        # RMS query/key norm; pow runs in fp32 under CUDA autocast
        q = q * torch.rsqrt(q.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        attn = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        if frame_mask is not None:
            mask = frame_mask.repeat_interleave(hh * ww, dim=0)[:, None, None, :]
            attn = attn.masked_fill(~mask, torch.finfo(attn.dtype).min)
        out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b * hh * ww, t, c)
        out = self.proj(out).reshape(b, hh, ww, t, c).permute(0, 4, 3, 1, 2)
        return x + out


ATTN_BLOCKS = {"temporal": TemporalAttention, "none": None}


class VideoUNet(nn.Module):
    def __init__(self, in_ch=4, base=128, mults=(1, 2, 4), attn_levels=(1, 2), attn_type="temporal", frame_gate=True):
        super().__init__()
        temb_dim = base * 4
        self.base = base
        self.time_mlp = nn.Sequential(nn.Linear(base, temb_dim), nn.SiLU(), nn.Linear(temb_dim, temb_dim))
        self.conv_in = nn.Conv3d(in_ch, base, (1, 3, 3), padding=(0, 1, 1))
        attn_cls = ATTN_BLOCKS[attn_type]
        self.down = nn.ModuleList()
        chans, ch = [base], base
        for level, mult in enumerate(mults):
            blk = nn.ModuleDict({"res": ResBlock3D(ch, base * mult, temb_dim, frame_gate=frame_gate)})
            ch = base * mult
            if attn_cls is not None and level in attn_levels:
                blk["attn"] = attn_cls(ch)
            self.down.append(blk)
            chans.append(ch)
        self.mid = ResBlock3D(ch, ch, temb_dim)
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(mults))):
            blk = nn.ModuleDict({"res": ResBlock3D(ch + chans.pop(), base * mult, temb_dim, frame_gate=frame_gate)})
            ch = base * mult
            if attn_cls is not None and level in attn_levels:
                blk["attn"] = attn_cls(ch)
            self.up.append(blk)
        self.out = nn.Sequential(GroupNorm32(32, ch), nn.SiLU(), nn.Conv3d(ch, in_ch, (1, 3, 3), padding=(0, 1, 1)))

    def forward(self, x, t, frame_mask=None):
        temb = self.time_mlp(timestep_embedding(t, self.base))
        h = self.conv_in(x)
        skips = [h]
        for blk in self.down:
            h = blk["res"](h, temb)
            if "attn" in blk:
                h = blk["attn"](h, frame_mask)
            skips.append(h)
        h = self.mid(h, temb)
        for blk in self.up:
            h = blk["res"](torch.cat([h, skips.pop()], dim=1), temb)
            if "attn" in blk:
                h = blk["attn"](h, frame_mask)
        return self.out(h)


def build_video_unet(cfg):
    return VideoUNet(base=cfg.base_channels, mults=tuple(cfg.channel_mults), attn_type=cfg.attn_type)


class VideoDiffusionTrainer:
    def __init__(self, cfg, local_rank):
        self.cfg = cfg
        self.device = torch.device("cuda", local_rank)
        self.vae = AutoencoderKL.from_pretrained(cfg.vae_path, subfolder="vae")
        self.vae.requires_grad_(False)
        self.vae.eval()
        self.vae.to(self.device, dtype=torch.bfloat16)
        self.unet = build_video_unet(cfg)
        self.unet.to(self.device)
        self.ema = copy.deepcopy(self.unet).eval().requires_grad_(False)
        self.model = DDP(self.unet, device_ids=[local_rank])
        self.optimizer = torch.optim.AdamW(self.unet.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        betas = torch.linspace(1e-4, 0.02, cfg.num_timesteps, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0).float()
        self.alphas_cumprod = alphas_cumprod.to(self.device)
        self.snr = self.alphas_cumprod / (1.0 - self.alphas_cumprod + 1e-8)
        self.step = 0

    @torch.no_grad()
    def encode(self, video):
        b, c, t, h, w = video.shape
        frames = video.transpose(1, 2).reshape(b * t, c, h, w).to(torch.bfloat16)
        latents = self.vae.encode(frames).latent_dist.sample() * self.vae.config.scaling_factor
        return latents.float().reshape(b, t, -1, h // 8, w // 8).transpose(1, 2)

    def q_sample(self, x0, t, noise):
        a = self.alphas_cumprod[t].view(-1, 1, 1, 1, 1)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def train_step(self, batch):
        latents = self.encode(batch["video"].to(self.device, non_blocking=True))
        frame_mask = batch["frame_mask"].to(self.device)
        noise = torch.randn_like(latents)
        t = torch.randint(0, self.cfg.num_timesteps, (latents.shape[0],), device=self.device)
        noisy = self.q_sample(latents, t, noise)
        weights = torch.clamp(self.snr[t], max=self.cfg.min_snr_gamma) / self.snr[t]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = self.model(noisy, t, frame_mask=frame_mask)
            mse = F.mse_loss(pred, noise, reduction="none").mean(dim=(1, 2, 3, 4))
            temporal_jitter = (pred[:, :, 1:] - pred[:, :, :-1]).abs().mean()  # expect: AMP004
            loss = (mse * weights).mean() + self.cfg.jitter_weight * temporal_jitter
            pred_std = pred.std()  # expect: AMP004
        self.scaler.scale(loss / self.cfg.grad_accum).backward()
        if (self.step + 1) % self.cfg.grad_accum == 0:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.unet.parameters(), self.cfg.max_grad_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.update_ema()
        self.step += 1
        return {"loss": loss.item(), "pred_std": pred_std.item()}

    @torch.no_grad()
    def update_ema(self, decay=0.9999):
        ema_params = list(self.ema.parameters())
        torch._foreach_lerp_(ema_params, list(self.unet.parameters()), 1.0 - decay)

    @torch.no_grad()
    def sample(self, shape, steps=50):
        x = torch.randn(shape, device=self.device)
        ts = torch.linspace(self.cfg.num_timesteps - 1, 0, steps, device=self.device).long()
        for i, t in enumerate(ts):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                eps = self.ema(x, t.expand(shape[0]))
            a = self.alphas_cumprod[t]
            x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
            x0 = x0 / x0.std(dim=(1, 2, 3, 4), keepdim=True).clamp(min=1.0)
            a_prev = self.alphas_cumprod[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0, device=self.device)
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
        return x

    def save(self, path):
        if dist.get_rank() == 0:
            torch.save({"unet": self.unet.state_dict(), "ema": self.ema.state_dict(),
                        "optimizer": self.optimizer.state_dict(), "step": self.step}, path)

    def fit(self, loader, max_steps):
        self.model.train()
        while self.step < max_steps:
            for batch in loader:
                logs = self.train_step(batch)
                if self.step % self.cfg.log_every == 0 and dist.get_rank() == 0:
                    print(f"step {self.step} loss {logs['loss']:.4f} pred_std {logs['pred_std']:.3f}")
                if self.step % self.cfg.save_every == 0:
                    self.save(f"{self.cfg.out_dir}/ckpt_{self.step:07d}.pt")
                if self.step >= max_steps:
                    break
