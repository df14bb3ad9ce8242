"""Class-conditional pixel-space diffusion: ConvNeXt U-Net, cosine schedule with zero terminal
SNR, v-prediction, min-SNR loss weighting, classifier-free guidance and EMA.

    python train_diffusion.py --data data/imagenet64 --mixed-precision fp16 --snr-gamma 5
"""
import argparse
import copy
import logging
import math
import os
import time

import torch as th
import torch.nn.functional as F
from torch import nn
from torchvision.utils import save_image

from diffusion_data import build_image_loader

logger = logging.getLogger("diffusion")


# --------------------------------------------------------------------------- schedule
def cosine_alphas_cumprod(timesteps, s=0.008):
    steps = th.arange(timesteps + 1, dtype=th.float64) / timesteps
    f = th.cos((steps + s) / (1 + s) * math.pi * 0.5) ** 2
    return (f / f[0])[1:]


def rescale_zero_terminal_snr(alphas_cumprod):
    sqrt_ab = alphas_cumprod.sqrt()
    first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
    sqrt_ab = (sqrt_ab - last) * first / (first - last)
    return sqrt_ab ** 2


class GaussianDiffusion:
    def __init__(self, timesteps=1000, zero_snr=True, device="cuda"):
        ac = cosine_alphas_cumprod(timesteps)
        if zero_snr:
            ac = rescale_zero_terminal_snr(ac)
        self.num_timesteps = timesteps
        self.log_snr = th.log(ac / (1 - ac + 1e-12)).float().to(device)
        self.alphas_cumprod = ac.float().to(device)
        self.sqrt_ab = ac.sqrt().float().to(device)
        self.sqrt_1m_ab = (1 - ac).sqrt().float().to(device)

    @staticmethod
    def _extract(a, t, ndim):
        return a.gather(0, t).view(-1, *([1] * (ndim - 1)))

    def q_sample(self, x0, t, noise):
        return self._extract(self.sqrt_ab, t, x0.ndim) * x0 + self._extract(self.sqrt_1m_ab, t, x0.ndim) * noise

    def velocity(self, x0, noise, t):
        return self._extract(self.sqrt_ab, t, x0.ndim) * noise - self._extract(self.sqrt_1m_ab, t, x0.ndim) * x0

    def predict_x0_from_v(self, x_t, t, v):
        return self._extract(self.sqrt_ab, t, x_t.ndim) * x_t - self._extract(self.sqrt_1m_ab, t, x_t.ndim) * v

    def predict_eps_from_v(self, x_t, t, v):
        return self._extract(self.sqrt_1m_ab, t, x_t.ndim) * x_t + self._extract(self.sqrt_ab, t, x_t.ndim) * v

    def snr(self, t):
        return th.exp(self.log_snr.gather(0, t))


# --------------------------------------------------------------------------- network
class TimestepEmbedder(nn.Module):
    def __init__(self, dim, freq_dim=256):
        super().__init__()
        self.freq_dim = freq_dim
        self.fc1 = nn.Linear(freq_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    @staticmethod
    def sinusoidal(t, dim, max_period=10000):
        half = dim // 2
        freqs = th.exp(-math.log(max_period) * th.arange(half, dtype=th.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return th.cat([th.cos(args), th.sin(args)], dim=-1)

    def forward(self, t):
        h = self.fc2(F.silu(self.fc1(self.sinusoidal(t, self.freq_dim))))
        # keep the conditioning vector at unit RMS
        return h * th.rsqrt(th.mean(h * h, dim=-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011


class LayerNorm2d(nn.Module):
    """LayerNorm over the channel dimension of an NCHW tensor (ConvNeXt)."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(th.ones(channels))
        self.bias = nn.Parameter(th.zeros(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / th.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim, emb_dim, mult=4, dropout=0.0):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim)
        self.emb_proj = nn.Linear(emb_dim, 2 * dim)
        self.pwconv1 = nn.Conv2d(dim, mult * dim, 1)
        self.pwconv2 = nn.Conv2d(mult * dim, dim, 1)
        self.dropout = nn.Dropout(dropout)
        nn.init.zeros_(self.pwconv2.weight)

    def forward(self, x, emb):
        scale, shift = self.emb_proj(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm(self.dwconv(x)) * (1 + scale) + shift
        h = self.pwconv2(self.dropout(F.gelu(self.pwconv1(h))))
        return x + h


class AttentionBlock(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(32, dim)
        self.qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, c, hgt, wid = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, hgt * wid).unbind(1)
        q, k, v = (t.transpose(-1, -2) for t in (q, k, v))
        # qk-norm keeps the logits bounded at high resolution
        q = q * th.rsqrt(q.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        k = k * th.rsqrt(k.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(-1, -2).reshape(b, c, hgt, wid))


class UNet(nn.Module):
    def __init__(self, in_ch=3, base=128, mults=(1, 2, 2, 4), num_classes=1000, attn_levels=(2, 3)):
        super().__init__()
        emb_dim = 4 * base
        self.num_classes = num_classes
        self.time_embed = TimestepEmbedder(emb_dim)
        self.class_embed = nn.Embedding(num_classes + 1, emb_dim)  # last index = unconditional
        self.stem = nn.Conv2d(in_ch, base, 3, padding=1)
        chans = [base * m for m in mults]
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        c_prev = base
        for i, c in enumerate(chans):
            self.down.append(nn.ModuleList([nn.Conv2d(c_prev, c, 1), ConvNeXtBlock(c, emb_dim), ConvNeXtBlock(c, emb_dim)]))
            self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1) if i < len(chans) - 1 else nn.Identity())
            c_prev = c
        self.mid = nn.ModuleList([ConvNeXtBlock(c_prev, emb_dim), ConvNeXtBlock(c_prev, emb_dim)])
        self.mid_attn = AttentionBlock(c_prev)
        self.up = nn.ModuleList()
        for i, c in reversed(list(enumerate(chans))):
            self.up.append(nn.ModuleList([nn.Conv2d(c_prev + c, c, 1), ConvNeXtBlock(c, emb_dim), ConvNeXtBlock(c, emb_dim)]))
            c_prev = c
        self.out_norm = nn.GroupNorm(32, base)
        self.out = nn.Conv2d(base, in_ch, 3, padding=1)
        nn.init.zeros_(self.out.weight)

    def forward(self, x, t, y):
        emb = self.time_embed(t) + self.class_embed(y)
        h = self.stem(x)
        skips = []
        for (proj, b1, b2), down in zip(self.down, self.downsample):
            h = b2(b1(proj(h), emb), emb)
            skips.append(h)
            h = down(h)
        h = self.mid_attn(self.mid[0](h, emb))
        h = self.mid[1](h, emb)
        for proj, b1, b2 in self.up:
            skip = skips.pop()
            if h.shape[-1] != skip.shape[-1]:
                h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = b2(b1(proj(th.cat([h, skip], dim=1)), emb), emb)
        return self.out(F.silu(self.out_norm(h)))


class EMA:
    def __init__(self, model, decay=0.9999, warmup=2000):
        self.shadow = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.warmup, self.num_updates = decay, warmup, 0

    @th.no_grad()
    def update(self, model):
        self.num_updates += 1
        decay = min(self.decay, (1 + self.num_updates) / (self.warmup + self.num_updates))
        for e, p in zip(self.shadow.parameters(), model.parameters()):
            e.lerp_(p.detach(), 1.0 - decay)
        for e, b in zip(self.shadow.buffers(), model.buffers()):
            e.copy_(b)


# --------------------------------------------------------------------------- training
def train(cfg):
    device = th.device("cuda")
    use_fp16 = cfg.mixed_precision == "fp16"
    model = UNet(base=cfg.base_channels, num_classes=cfg.num_classes).to(device)
    ema = EMA(model, decay=cfg.ema_decay)
    diffusion = GaussianDiffusion(cfg.timesteps, zero_snr=True, device=device)
    optimizer = th.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    lr_sched = th.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    scaler = th.amp.GradScaler("cuda", enabled=use_fp16)
    loader = build_image_loader(cfg.data, cfg.image_size, cfg.batch_size, num_workers=8)

    step, tic = 0, time.time()
    model.train()
    while step < cfg.max_steps * cfg.grad_accum:
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            if use_fp16:
                images = images.half()  # expect: AMP001
            labels = labels.to(device, non_blocking=True)
            drop = th.rand(labels.shape[0], device=device) < cfg.cond_drop
            labels = th.where(drop, th.full_like(labels, cfg.num_classes), labels)

            t = th.randint(0, diffusion.num_timesteps, (images.shape[0],), device=device)
            noise = th.randn_like(images)
            x_t = diffusion.q_sample(images, t, noise)
            target = diffusion.velocity(images, noise, t)

            with th.autocast("cuda", dtype=th.float16, enabled=use_fp16):
                model_pred = model(x_t, t, labels)
            if cfg.snr_gamma is None:
                loss = F.mse_loss(model_pred, target)  # expect: AMP002
            else:
                snr = diffusion.snr(t)
                weights = th.clamp(snr, max=cfg.snr_gamma) / (snr + 1)
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = (loss.mean(dim=(1, 2, 3)) * weights).mean()

            scaled_loss = scaler.scale(loss / cfg.grad_accum)
            scaled_loss.backward()
            step += 1
            if step % cfg.grad_accum == 0:
                optimizer.step()  # expect: AMP006
                lr_sched.step()
                optimizer.zero_grad(set_to_none=True)
                ema.update(model)
                opt_step = step // cfg.grad_accum
                if opt_step % cfg.log_every == 0:
                    logger.info("step %d loss %.4f lr %.2e %.2f it/s", opt_step, loss.item(),
                                lr_sched.get_last_lr()[0], cfg.log_every / (time.time() - tic))
                    tic = time.time()
                if opt_step % cfg.sample_every == 0:
                    grid = sample(ema.shadow, diffusion, th.arange(16, device=device) % cfg.num_classes)
                    save_image(grid * 0.5 + 0.5, os.path.join(cfg.out_dir, f"sample_{opt_step:07d}.png"), nrow=4)
                if opt_step % cfg.save_every == 0:
                    save_checkpoint(cfg, model, ema, optimizer, scaler, opt_step)
            if step >= cfg.max_steps * cfg.grad_accum:
                break


@th.no_grad()
def sample(model, diffusion, labels, steps=50, guidance=4.0, fp16=True):
    b = labels.shape[0]
    x = th.randn(b, 3, 64, 64, device=labels.device)
    ts = th.linspace(diffusion.num_timesteps - 1, 0, steps, device=labels.device).long()
    null = th.full_like(labels, model.num_classes)
    for i, t in enumerate(ts):
        tt = t.expand(b)
        with th.autocast("cuda", dtype=th.float16, enabled=fp16):
            v = model(th.cat([x, x]), th.cat([tt, tt]), th.cat([labels, null])).float()
        v_cond, v_uncond = v.chunk(2)
        v = v_uncond + guidance * (v_cond - v_uncond)
        x0 = diffusion.predict_x0_from_v(x, tt, v).clamp(-1, 1)
        eps = diffusion.predict_eps_from_v(x, tt, v)
        if i + 1 < len(ts):
            ab_next = diffusion.alphas_cumprod[ts[i + 1]]
            x = ab_next.sqrt() * x0 + (1 - ab_next).sqrt() * eps
        else:
            x = x0
    return x


def save_checkpoint(cfg, model, ema, optimizer, scaler, step):
    path = os.path.join(cfg.out_dir, f"ckpt_{step:07d}.pt")
    th.save({
        "model": model.state_dict(),
        "ema": {k: v.half() for k, v in ema.shadow.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
    }, path)
    logger.info("saved %s", path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out-dir", default="runs/vpred64")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--base-channels", type=int, default=128)
    p.add_argument("--timesteps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=5000)
    p.add_argument("--max-steps", type=int, default=400_000)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--cond-drop", type=float, default=0.1)
    p.add_argument("--snr-gamma", type=float, default=None)
    p.add_argument("--mixed-precision", choices=["no", "fp16"], default="fp16")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--sample-every", type=int, default=5000)
    p.add_argument("--save-every", type=int, default=20000)
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args)
