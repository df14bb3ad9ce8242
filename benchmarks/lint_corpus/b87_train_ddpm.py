"""DDPM (epsilon prediction) on 64x64 image folders with a compact UNet and EMA."""
import argparse
import copy
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.utils import save_image


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim, dropout):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(32, cout)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.drop(F.silu(self.norm2(h))))
        return h + self.skip(x)


class AttnBlock(nn.Module):
    def __init__(self, ch, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(32, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        out = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.proj(out.transpose(-1, -2).reshape(b, c, h, w))


class UNet(nn.Module):
    def __init__(self, ch=64, mults=(1, 2, 2, 4), dropout=0.1):
        super().__init__()
        tdim = ch * 4
        self.ch = ch
        self.time_mlp = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inc = nn.Conv2d(3, ch, 3, padding=1)
        self.downs, chans, c = nn.ModuleList(), [ch], ch
        for i, m in enumerate(mults):
            self.downs.append(ResBlock(c, ch * m, tdim, dropout))
            c = ch * m
            chans.append(c)
            if i < len(mults) - 1:
                self.downs.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                chans.append(c)
        self.mid1, self.mid_attn, self.mid2 = ResBlock(c, c, tdim, dropout), AttnBlock(c), ResBlock(c, c, tdim, dropout)
        self.ups = nn.ModuleList()
        for i, m in reversed(list(enumerate(mults))):
            for _ in range(2):
                self.ups.append(ResBlock(c + chans.pop(), ch * m, tdim, dropout))
                c = ch * m
            if i > 0:
                self.ups.append(nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, padding=1)))
        self.out_norm = nn.GroupNorm(32, c)
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x, t):
        temb = self.time_mlp(timestep_embedding(t, self.ch))
        h = self.inc(x)
        hs = [h]
        for layer in self.downs:
            h = layer(h, temb) if isinstance(layer, ResBlock) else layer(h)
            hs.append(h)
        h = self.mid2(self.mid_attn(self.mid1(h, temb)), temb)
        for layer in self.ups:
            h = layer(torch.cat([h, hs.pop()], dim=1), temb) if isinstance(layer, ResBlock) else layer(h)
        return self.out(F.silu(self.out_norm(h)))


class LinearSchedule:
    def __init__(self, T=1000, beta_start=1e-4, beta_end=0.02, device="cpu"):
        self.T = T
        betas = torch.linspace(beta_start, beta_end, T, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.betas = betas.float().to(device)
        self.alphas_cumprod = alphas_cumprod.float().to(device)
        self.sqrt_ac = alphas_cumprod.sqrt().float().to(device)
        self.sqrt_one_minus_ac = (1.0 - alphas_cumprod).sqrt().float().to(device)

    def q_sample(self, x0, t, noise):
        a = self.sqrt_ac[t].view(-1, 1, 1, 1)
        b = self.sqrt_one_minus_ac[t].view(-1, 1, 1, 1)
        return a * x0 + b * noise

    @torch.inference_mode()
    def sample(self, model, n, size, device):
        x = torch.randn(n, 3, size, size, device=device)
        for i in reversed(range(self.T)):
            t = torch.full((n,), i, device=device, dtype=torch.long)
            eps = model(x, t).float()
            beta, ac = self.betas[i], self.alphas_cumprod[i]
            mean = (x - beta / (1 - ac).sqrt() * eps) / (1 - beta).sqrt()
            x = mean + beta.sqrt() * torch.randn_like(x) if i > 0 else mean
        return x.clamp(-1, 1)


class EMA:
    def __init__(self, model, decay=0.9999):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.model.parameters(), model.parameters()):
            e.lerp_(p, 1.0 - self.decay)


@torch.no_grad()
def estimate_pixel_std(loader, device, max_batches=20):
    sq_sum, count = 0.0, 0
    for i, (x, _) in enumerate(loader):
        if i >= max_batches:
            break
        x = x.to(device).half()
        sq_sum += x.pow(2).sum().item()  # expect: AMP004
        count += x.numel()
    return math.sqrt(sq_sum / count)


def save_preview(ema_model, schedule, path, device, n=16, size=64):
    if device.type == "cuda":
        amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        amp_ctx = torch.cpu.amp.autocast(dtype=torch.bfloat16)  # expect: AMP009
    with amp_ctx:
        imgs = schedule.sample(ema_model, n, size, device)
    save_image((imgs + 1) / 2, path, nrow=4)


@torch.no_grad()
def export_half_weights(ema_model, path):
    half_model = copy.deepcopy(ema_model).half()
    torch.save(half_model.state_dict(), path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=400_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--sample-every", type=int, default=10_000)
    p.add_argument("--out", default="runs/ddpm64")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tf = T.Compose([T.Resize(64), T.CenterCrop(64), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])
    dataset = torchvision.datasets.ImageFolder(args.data, tf)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True, pin_memory=True)
    print(f"pixel std ~ {estimate_pixel_std(loader, device):.3f}")

    model = UNet().to(device)
    ema = EMA(model)
    schedule = LinearSchedule(device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    os.makedirs(args.out, exist_ok=True)

    step, data_iter = 0, iter(loader)
    while step < args.steps:
        try:
            images, _ = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            images, _ = next(data_iter)
        x0 = images.to(device, dtype=torch.bfloat16, non_blocking=True)  # expect: AMP001
        t = torch.randint(0, schedule.T, (x0.size(0),), device=device)
        noise = torch.randn_like(x0)
        x_t = schedule.q_sample(x0, t, noise)

        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            pred = model(x_t, t)
            loss = F.mse_loss(pred.float(), noise.float())
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)
        step += 1

        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} scale {scaler.get_scale():.0f}")
        if step % args.sample_every == 0:
            save_preview(ema.model, schedule, os.path.join(args.out, f"sample_{step:07d}.png"), device)
            torch.save({"model": model.state_dict(), "ema": ema.model.state_dict(), "step": step},
                       os.path.join(args.out, "ckpt.pt"))

    export_half_weights(ema.model, os.path.join(args.out, "ema_fp16.pt"))


if __name__ == "__main__":
    main()
