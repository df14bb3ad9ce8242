"""Class-conditional DDPM UNet: GroupNorm res-blocks with scale/shift timestep
conditioning, linear attention at high resolution and full (optionally
cross-) attention at low resolution.

Trained with fp16 autocast + GradScaler; EMA weights are used for sampling.
"""
import argparse
import copy
import logging
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from datasets.folder import build_image_dataset
from utils.dist import is_main_process
from utils.ema import ModelEma

logger = logging.getLogger("unet")

UNET_CONFIGS = {
    "ddpm_64": dict(base_ch=128, ch_mult=(1, 2, 2, 4), num_res_blocks=2, attn_levels=(2, 3),
                    linear_attn_levels=(0, 1), dropout=0.1, act="SiLU", context_dim=None),
    "txt_64": dict(base_ch=192, ch_mult=(1, 2, 3, 4), num_res_blocks=2, attn_levels=(2, 3),
                   linear_attn_levels=(1,), dropout=0.0, act="SiLU", context_dim=768),
}


def timestep_embedding(t, dim, max_period=10000):
    """Sinusoidal timestep embedding (computed in fp32)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def group_norm(ch, groups=32):
    return nn.GroupNorm(min(groups, ch // 4), ch, eps=1e-6)


class ChanRMSNorm(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.scale = ch ** 0.5
        self.g = nn.Parameter(torch.ones(1, ch, 1, 1))

    def forward(self, x):
        return F.normalize(x, dim=1) * self.g * self.scale


class ChanLayerNorm(nn.Module):
    """LayerNorm over the channel axis of an NCHW feature map."""

    def __init__(self, ch):
        super().__init__()
        self.g = nn.Parameter(torch.ones(1, ch, 1, 1))

    def forward(self, x):
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)  # expect: AMP004
        mean = torch.mean(x, dim=1, keepdim=True)  # expect: AMP004
        return (x - mean) * (var + eps).rsqrt() * self.g


class WSConv2d(nn.Conv2d):
    def forward(self, x):
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        w = (w - mean) * (var + eps).rsqrt()
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, temb_ch, dropout=0.0, act="SiLU", ws=False):
        super().__init__()
        conv = WSConv2d if ws else nn.Conv2d
        self.norm1 = group_norm(in_ch)
        self.conv1 = conv(in_ch, out_ch, 3, padding=1)
        self.temb_proj = nn.Linear(temb_ch, out_ch * 2)
        self.norm2 = group_norm(out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.act = getattr(nn, act)()
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x, temb):
        h = self.conv1(self.act(self.norm1(x)))
        scale, shift = self.temb_proj(self.act(temb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(self.dropout(self.act(h)))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, ch, heads=4, context_dim=None):
        super().__init__()
        self.heads = heads
        self.scale = (ch // heads) ** -0.5
        self.norm = group_norm(ch)
        self.qkv = nn.Conv2d(ch, ch * 3, 1)
        self.ctx_kv = nn.Linear(context_dim, ch * 2) if context_dim else None
        self.proj_out = nn.Conv2d(ch, ch, 1)
        nn.init.zeros_(self.proj_out.weight)

    def forward(self, x, context=None, context_mask=None):
        b, c, hh, ww = x.shape
        d = c // self.heads
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, d, hh * ww).unbind(1)
        if context is not None and self.ctx_kv is not None:
            ck, cv = self.ctx_kv(context).chunk(2, dim=-1)
            ck = ck.reshape(b, -1, self.heads, d).permute(0, 2, 3, 1)
            cv = cv.reshape(b, -1, self.heads, d).permute(0, 2, 3, 1)
            k = torch.cat([k, ck], dim=-1)
            v = torch.cat([v, cv], dim=-1)
        sim = torch.matmul(q.transpose(-2, -1) * self.scale, k)
        if context is not None and context_mask is not None:
            keep = F.pad(context_mask, (hh * ww, 0), value=True)
            sim = sim.masked_fill(~keep[:, None, None, :], -1e9)  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = torch.matmul(v, attn.transpose(-2, -1))
        return x + self.proj_out(out.reshape(b, c, hh, ww))


class LinearAttnBlock(nn.Module):
    """Efficient (softmax-kernel) linear attention used at high resolutions."""

    def __init__(self, ch, heads=4, dim_head=32):
        super().__init__()
        hidden = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.norm = ChanRMSNorm(ch)
        self.to_qkv = nn.Conv2d(ch, hidden * 3, 1, bias=False)
        self.to_out = nn.Sequential(nn.Conv2d(hidden, ch, 1), ChanLayerNorm(ch))

    def forward(self, x):
        b, c, hh, ww = x.shape
        q, k, v = (t.reshape(b, self.heads, -1, hh * ww) for t in self.to_qkv(self.norm(x)).chunk(3, dim=1))
        q = q.softmax(dim=-2) * self.scale
        k = k.softmax(dim=-1)
        context = torch.matmul(k, v.transpose(-2, -1))
        out = torch.matmul(context.transpose(-2, -1), q)
        return x + self.to_out(out.reshape(b, -1, hh, ww))


class DownStage(nn.Module):
    def __init__(self, in_ch, out_ch, temb_ch, num_blocks, attn, linear_attn, dropout, act,
                 context_dim, downsample):
        super().__init__()
        self.blocks = nn.ModuleList(
            [ResBlock(in_ch if i == 0 else out_ch, out_ch, temb_ch, dropout, act) for i in range(num_blocks)]
        )
        self.attn = AttnBlock(out_ch, context_dim=context_dim) if attn else None
        self.lin_attn = LinearAttnBlock(out_ch) if linear_attn else nn.Identity()
        self.down = nn.Conv2d(out_ch, out_ch, 3, stride=2, padding=1) if downsample else nn.Identity()

    def forward(self, x, temb, context=None, context_mask=None):
        for block in self.blocks:
            x = block(x, temb)
        if self.attn is not None:
            x = self.attn(x, context, context_mask)
        x = self.lin_attn(x)
        return x, self.down(x)


class UpStage(nn.Module):
    def __init__(self, in_ch, skip_ch, out_ch, temb_ch, num_blocks, attn, linear_attn, dropout, act,
                 context_dim, upsample):
        super().__init__()
        self.up = (
            nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(in_ch, in_ch, 3, padding=1))
            if upsample else nn.Identity()
        )
        self.blocks = nn.ModuleList(
            [ResBlock(in_ch + skip_ch if i == 0 else out_ch, out_ch, temb_ch, dropout, act) for i in range(num_blocks)]
        )
        self.attn = AttnBlock(out_ch, context_dim=context_dim) if attn else None
        self.lin_attn = LinearAttnBlock(out_ch) if linear_attn else nn.Identity()

    def forward(self, x, skip, temb, context=None, context_mask=None):
        x = torch.cat([self.up(x), skip], dim=1)
        for block in self.blocks:
            x = block(x, temb)
        if self.attn is not None:
            x = self.attn(x, context, context_mask)
        return self.lin_attn(x)


class UNet(nn.Module):
    def __init__(self, cfg, in_ch=3, num_classes=None):
        super().__init__()
        ch = cfg["base_ch"]
        temb_ch = ch * 4
        self.base_ch = ch
        self.time_embed = nn.Sequential(
            nn.Linear(ch, temb_ch), getattr(nn, cfg["act"])(), nn.Linear(temb_ch, temb_ch)
        )
        self.label_emb = nn.Embedding(num_classes + 1, temb_ch) if num_classes else None
        self.conv_in = nn.Conv2d(in_ch, ch, 3, padding=1)

        n_levels = len(cfg["ch_mult"])
        level_ch = [ch * m for m in cfg["ch_mult"]]
        common = dict(dropout=cfg["dropout"], act=cfg["act"], context_dim=cfg["context_dim"])
        downs, cur = [], ch
        for level, out in enumerate(level_ch):
            downs.append(DownStage(cur, out, temb_ch, cfg["num_res_blocks"], level in cfg["attn_levels"],
                                   level in cfg["linear_attn_levels"], downsample=level < n_levels - 1, **common))
            cur = out
        self.downs = nn.ModuleList(downs)

        self.mid1 = ResBlock(cur, cur, temb_ch, cfg["dropout"], cfg["act"])
        self.mid_attn = AttnBlock(cur, context_dim=cfg["context_dim"])
        self.mid2 = ResBlock(cur, cur, temb_ch, cfg["dropout"], cfg["act"])

        ups = []
        for level in reversed(range(n_levels)):
            out = level_ch[level]
            ups.append(UpStage(cur, out, out, temb_ch, cfg["num_res_blocks"] + 1, level in cfg["attn_levels"],
                               level in cfg["linear_attn_levels"], upsample=level < n_levels - 1, **common))
            cur = out
        self.ups = nn.ModuleList(ups)
        self.norm_out = group_norm(cur)
        self.conv_out = nn.Conv2d(cur, in_ch, 3, padding=1)

    def forward(self, x, t, y=None, context=None, context_mask=None):
        temb = self.time_embed(timestep_embedding(t, self.base_ch))
        if self.label_emb is not None and y is not None:
            temb = temb + self.label_emb(y)
        h = self.conv_in(x)
        skips = []
        for stage in self.downs:
            skip, h = stage(h, temb, context, context_mask)
            skips.append(skip)
        h = self.mid1(h, temb)
        h = self.mid_attn(h, context, context_mask)
        h = self.mid2(h, temb)
        for stage in self.ups:
            h = stage(h, skips.pop(), temb, context, context_mask)
        return self.conv_out(F.silu(self.norm_out(h)))


def build_model(arch, num_classes=None):
    cfg = dict(UNET_CONFIGS[arch])
    return UNet(cfg, num_classes=num_classes)


class NoiseSchedule:
    def __init__(self, timesteps=1000, schedule="cosine", device="cpu"):
        if schedule == "linear":
            betas = torch.linspace(1e-4, 0.02, timesteps, dtype=torch.float64)
        else:
            s = 0.008
            steps = torch.arange(timesteps + 1, dtype=torch.float64) / timesteps
            ac = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
            betas = (1 - ac[1:] / ac[:-1]).clamp(max=0.999)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.num_timesteps = timesteps
        self.betas = betas.float().to(device)
        self.alphas_cumprod = alphas_cumprod.float().to(device)
        self.sqrt_ac = alphas_cumprod.sqrt().float().to(device)
        self.sqrt_1m_ac = (1.0 - alphas_cumprod).sqrt().float().to(device)

    def q_sample(self, x0, t, noise):
        return self.sqrt_ac[t].view(-1, 1, 1, 1) * x0 + self.sqrt_1m_ac[t].view(-1, 1, 1, 1) * noise


class MinSNRLoss(nn.Module):
    """epsilon-prediction MSE re-weighted by min(SNR, gamma) / SNR."""

    def __init__(self, alphas_cumprod, gamma=5.0):
        super().__init__()
        snr = alphas_cumprod / (1.0 - alphas_cumprod + 1e-8)
        self.register_buffer("weight", torch.clamp(snr, max=gamma) / snr)

    def forward(self, pred, target, t):
        loss = F.mse_loss(pred, target, reduction="none")
        loss = loss.mean(dim=(1, 2, 3))
        return (loss * self.weight[t]).mean()


def train_one_epoch(model, schedule, criterion, loader, optimizer, scaler, ema, args, epoch):
    model.train()
    device = args.device
    grad_norm = torch.zeros(())
    t0 = time.time()
    for step, batch in enumerate(loader):
        x0 = batch["image"].to(device, non_blocking=True) * 2.0 - 1.0
        y = batch.get("label")
        if y is not None:
            y = y.to(device, non_blocking=True)
            drop = torch.rand(y.shape[0], device=device) < args.cond_drop
            y = torch.where(drop, torch.full_like(y, args.num_classes), y)
        noise = torch.randn_like(x0)
        t = torch.randint(0, schedule.num_timesteps, (x0.shape[0],), device=device)
        x_t = schedule.q_sample(x0, t, noise)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            pred = model(x_t, t, y)
            loss = criterion(pred, noise, t) / args.grad_accum
        scaler.scale(loss).backward()
        if (step + 1) % args.grad_accum == 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()  # expect: AMP006
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model)
        if step % args.log_every == 0 and is_main_process():
            pred_std = pred.detach().std().item()  # expect: AMP004
            logger.info(
                "epoch %d step %d loss %.4f grad_norm %.3f pred_std %.3f scale %.0f (%.1fs)",
                epoch, step, loss.item() * args.grad_accum, float(grad_norm), pred_std,
                scaler.get_scale(), time.time() - t0,
            )


@torch.no_grad()
def sample_images(model, schedule, n, image_size, device, num_classes=None, guidance=3.0, amp=True):
    model.eval()
    x = torch.randn(n, 3, image_size, image_size, device=device)
    y = torch.randint(0, num_classes, (n,), device=device) if num_classes else None
    for i in reversed(range(schedule.num_timesteps)):
        t = torch.full((n,), i, device=device, dtype=torch.long)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            eps = model(x, t, y)
            if y is not None:
                eps_uncond = model(x, t, torch.full_like(y, num_classes))
                eps = eps_uncond + guidance * (eps - eps_uncond)
        if i % 200 == 0:
            logger.debug("t=%d eps std %.4f", i, eps.std().item())
        eps = eps.float()
        beta = schedule.betas[i]
        mean = (x - beta / schedule.sqrt_1m_ac[i] * eps) / torch.sqrt(1.0 - beta)
        x = mean + (torch.sqrt(beta) * torch.randn_like(x) if i > 0 else 0.0)
    return (x.clamp(-1, 1) + 1) / 2


def export_fp16_weights(ema_model, path):
    half_model = copy.deepcopy(ema_model).half()
    torch.save({"state_dict": half_model.state_dict()}, path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="ddpm_64", choices=sorted(UNET_CONFIGS))
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=0)
    p.add_argument("--cond-drop", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1)
    for name, val in (("--lr", 2e-4), ("--clip-grad", 1.0)):
        p.add_argument(name, type=float, default=val)
    for name, val in (("--epochs", 500), ("--timesteps", 1000), ("--log-every", 100)):
        p.add_argument(name, type=int, default=val)
    p.add_argument("--no-amp", dest="amp", action="store_false")
    p.add_argument("--out", default="runs/unet")
    return p.parse_args()


def main():
    args = parse_args()
    args.device = "cuda"
    os.makedirs(args.out, exist_ok=True)
    dataset = build_image_dataset(args.data, args.image_size, with_labels=args.num_classes > 0)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=8,
                        pin_memory=True, drop_last=True)

    model = build_model(args.arch, num_classes=args.num_classes or None).to(args.device)
    ema = ModelEma(model, decay=0.9999)
    schedule = NoiseSchedule(args.timesteps, device=args.device)
    criterion = MinSNRLoss(schedule.alphas_cumprod).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    best_loss = 1e9
    for epoch in range(args.epochs):
        train_one_epoch(model, schedule, criterion, loader, optimizer, scaler, ema, args, epoch)
        if is_main_process() and epoch % 10 == 0:
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best_loss": best_loss},
                       os.path.join(args.out, "last.pt"))
            samples = sample_images(ema.module, schedule, 16, args.image_size, args.device,
                                    num_classes=args.num_classes or None)
            torch.save(samples.cpu(), os.path.join(args.out, f"samples_{epoch:04d}.pt"))
    export_fp16_weights(ema.module, os.path.join(args.out, "ema_fp16.pt"))


if __name__ == "__main__":
    main()
