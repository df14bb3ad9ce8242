"""Class-conditional DDPM training on 64x64 images (guided-diffusion style UNet).

Training runs the UNet under fp16 autocast with a GradScaler; the noise schedule, the
posterior and the sampler stay in fp32. An EMA copy of the UNet is used for sampling and
is what gets exported as the fp16 inference checkpoint.
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(timesteps, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, temb_ch, dropout=0.1, use_gate=True):
        super().__init__()
        self.norm1 = GroupNorm32(32, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.temb_proj = nn.Linear(temb_ch, out_ch)
        self.norm2 = GroupNorm32(32, out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.use_gate = use_gate
        self.gate = nn.Sequential(nn.Linear(out_ch, out_ch // 4), nn.SiLU(), nn.Linear(out_ch // 4, out_ch))
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        if self.use_gate:
            w = self.gate(h.mean(dim=(2, 3)))  # expect: AMP004
            h = h * torch.sigmoid(w)[:, :, None, None]
        return self.skip(x) + h


class AttentionBlock(nn.Module):
    def __init__(self, channels, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.norm = GroupNorm32(32, channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.proj_out = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        b, c, *spatial = x.shape
        qkv = self.qkv(self.norm(x).reshape(b, c, -1))
        q, k, v = qkv.reshape(b * self.num_heads, 3 * c // self.num_heads, -1).chunk(3, dim=1)
        scale = 1 / math.sqrt(math.sqrt(c // self.num_heads))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        a = torch.einsum("bts,bcs->bct", weight, v).reshape(b, c, -1)
        return x + self.proj_out(a).reshape(b, c, *spatial)


class UNet(nn.Module):
    def __init__(self, in_ch=3, base=128, mults=(1, 2, 2, 4), num_classes=1000, attn_res=(16,), img_size=64):
        super().__init__()
        temb_ch = base * 4
        self.base, self.num_classes = base, num_classes
        self.time_embed = nn.Sequential(nn.Linear(base, temb_ch), nn.SiLU(), nn.Linear(temb_ch, temb_ch))
        self.label_emb = nn.Embedding(num_classes + 1, temb_ch)  # last index = unconditional
        self.conv_in = nn.Conv2d(in_ch, base, 3, padding=1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        chans, ch, res = [], base, img_size
        for i, m in enumerate(mults):
            self.down.append(ResBlock(ch, base * m, temb_ch))
            ch = base * m
            chans.append(ch)
            if res in attn_res:
                self.down.append(AttentionBlock(ch))
            if i != len(mults) - 1:
                self.down.append(nn.Conv2d(ch, ch, 3, stride=2, padding=1))
                res //= 2
        self.mid_block1 = ResBlock(ch, ch, temb_ch)
        self.mid_attn = AttentionBlock(ch)
        self.mid_block2 = ResBlock(ch, ch, temb_ch)
        for i, m in reversed(list(enumerate(mults))):
            self.up.append(ResBlock(ch + chans.pop(), base * m, temb_ch))
            ch = base * m
            if i != 0:
                self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
        self.norm_out = GroupNorm32(32, ch)
        self.conv_out = nn.Conv2d(ch, in_ch, 3, padding=1)

    def forward(self, x, timesteps, class_labels):
        temb = self.time_embed(timestep_embedding(timesteps, self.base)) + self.label_emb(class_labels)
        h = self.conv_in(x)
        skips = []
        for layer in self.down:
            if isinstance(layer, ResBlock):
                h = layer(h, temb)
                skips.append(h)
            else:
                h = layer(h)
        h = self.mid_block1(h, temb)
        h = self.mid_attn(h)
        h = self.mid_block2(h, temb)
        for layer in self.up:
            if isinstance(layer, ResBlock):
                h = layer(torch.cat([h, skips.pop()], dim=1), temb)
            else:
                h = layer(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class GaussianDiffusion:
    """Linear-beta DDPM schedule; every buffer is fp32 and lives outside autocast."""

    def __init__(self, num_timesteps=1000, device="cuda"):
        betas = np.linspace(1e-4, 0.02, num_timesteps, dtype=np.float64)
        alphas_cumprod = np.cumprod(1.0 - betas)
        alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)

        def to_t(a):
            return torch.tensor(a, dtype=torch.float32, device=device)

        self.num_timesteps = num_timesteps
        self.betas = to_t(betas)
        self.alphas_cumprod = to_t(alphas_cumprod)
        self.sqrt_alphas_cumprod = to_t(np.sqrt(alphas_cumprod))
        self.sqrt_one_minus_alphas_cumprod = to_t(np.sqrt(1.0 - alphas_cumprod))
        self.sqrt_recip_alphas_cumprod = to_t(np.sqrt(1.0 / alphas_cumprod))
        self.sqrt_recipm1_alphas_cumprod = to_t(np.sqrt(1.0 / alphas_cumprod - 1))
        self.posterior_variance = to_t(posterior_variance)
        self.posterior_log_variance = torch.log(self.posterior_variance.clamp(min=1e-20))
        self.posterior_mean_coef1 = to_t(betas * np.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod))
        self.posterior_mean_coef2 = to_t((1.0 - alphas_cumprod_prev) * np.sqrt(1.0 - betas) / (1.0 - alphas_cumprod))
        self.snr = self.alphas_cumprod / (1.0 - self.alphas_cumprod + 1e-8)

    @staticmethod
    def _extract(arr, t, ndim):
        return arr[t].float().reshape(-1, *([1] * (ndim - 1)))

    def q_sample(self, x_start, t, noise):
        return (self._extract(self.sqrt_alphas_cumprod, t, x_start.ndim) * x_start
                + self._extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.ndim) * noise)

    def min_snr_weights(self, t, gamma):
        snr = self.snr[t]
        return torch.stack([snr, gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0] / snr

    @torch.no_grad()
    def p_sample_loop(self, model, shape, class_labels, guidance_scale=3.0, use_fp16=True):
        x = torch.randn(shape, device=class_labels.device)
        uncond = torch.full_like(class_labels, model.num_classes)
        for i in reversed(range(self.num_timesteps)):
            t = torch.full((shape[0],), i, device=x.device, dtype=torch.long)
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_fp16):
                eps_c = model(x, t, class_labels)
                eps_u = model(x, t, uncond)
            eps_c, eps_u = eps_c.float(), eps_u.float()
            eps = eps_u + guidance_scale * (eps_c - eps_u)
            x0 = self._extract(self.sqrt_recip_alphas_cumprod, t, x.ndim) * x - self._extract(self.sqrt_recipm1_alphas_cumprod, t, x.ndim) * eps
            s = torch.quantile(x0.abs().reshape(shape[0], -1), 0.995, dim=1).clamp(min=1.0)
            x0 = x0.clamp(-s[:, None, None, None], s[:, None, None, None]) / s[:, None, None, None]
            mean = self._extract(self.posterior_mean_coef1, t, x.ndim) * x0 + self._extract(self.posterior_mean_coef2, t, x.ndim) * x
            noise = torch.randn_like(x) if i > 0 else torch.zeros_like(x)
            x = mean + torch.exp(0.5 * self._extract(self.posterior_log_variance, t, x.ndim)) * noise
        return x


class EMA:
    def __init__(self, model, decay=0.9999):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model, step):
        decay = min(self.decay, (1 + step) / (10 + step))
        for s_param, param in zip(self.model.parameters(), model.parameters()):
            s_param.sub_((1.0 - decay) * (s_param - param.detach()))


def export_fp16_unet(ema, path):
    unet_fp16 = copy.deepcopy(ema.model).half()
    torch.save(unet_fp16.state_dict(), path)


def save_samples(images, path):
    images = (images * 127.5 + 127.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    np.save(path, images)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="imagenet64.npz")
    parser.add_argument("--output_dir", default="ddpm-out")
    parser.add_argument("--mixed_precision", choices=["no", "fp16"], default="fp16")
    parser.add_argument("--snr_gamma", type=float, default=None)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--cond_drop_prob", type=float, default=0.1)
    parser.add_argument("--max_steps", type=int, default=400_000)
    parser.add_argument("--sample_every", type=int, default=10_000)
    args = parser.parse_args()
    device = "cuda"
    os.makedirs(args.output_dir, exist_ok=True)

    data = np.load(args.data)
    images = torch.from_numpy(data["x"]).permute(0, 3, 1, 2)  # uint8 NCHW
    labels = torch.from_numpy(data["y"]).long()

    unet = UNet().to(device)
    ema = EMA(unet)
    diffusion = GaussianDiffusion(device=device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=0.0, eps=1e-8)
    use_fp16 = args.mixed_precision == "fp16"
    scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16, enabled=use_fp16)
    loss_avg = None

    for step in range(args.max_steps):
        idx = torch.randint(0, images.shape[0], (args.batch_size,))
        x_start = images[idx].to(device, non_blocking=True).float() / 127.5 - 1.0
        y = labels[idx].to(device, non_blocking=True)
        drop = torch.rand(y.shape, device=device) < args.cond_drop_prob
        y = torch.where(drop, torch.full_like(y, unet.num_classes), y)

        noise = torch.randn_like(x_start) + 0.05 * torch.randn(x_start.shape[0], x_start.shape[1], 1, 1, device=device)
        t = torch.randint(0, diffusion.num_timesteps, (x_start.shape[0],), device=device)
        x_t = diffusion.q_sample(x_start, t, noise)

        with amp_ctx:
            noise_pred = unet(x_t, t, y)
        if args.snr_gamma is None:
            loss = F.mse_loss(noise_pred, noise)  # expect: AMP002
        else:
            loss = F.mse_loss(noise_pred.float(), noise.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, loss.ndim))) * diffusion.min_snr_weights(t, args.snr_gamma)
            loss = loss.mean()

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        ema.update(unet, step)

        loss_avg = loss.item() if loss_avg is None else 0.99 * loss_avg + 0.01 * loss.item()
        if step % 100 == 0:
            print(f"step {step} loss {loss_avg:.4f} grad_norm {grad_norm.item():.3f} scale {scaler.get_scale():.0f}")
        if step > 0 and step % args.sample_every == 0:
            classes = torch.arange(16, device=device) * 61 % unet.num_classes
            samples = diffusion.p_sample_loop(ema.model, (16, 3, 64, 64), classes, use_fp16=use_fp16)
            save_samples(samples, os.path.join(args.output_dir, f"samples_{step:07d}.npy"))
            state = {"unet": unet.state_dict(), "ema": {k: v.half() for k, v in ema.model.state_dict().items()},
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step}
            torch.save(state, os.path.join(args.output_dir, "checkpoint.pt"))

    export_fp16_unet(ema, os.path.join(args.output_dir, "unet_ema_fp16.pt"))


if __name__ == "__main__":
    main()
