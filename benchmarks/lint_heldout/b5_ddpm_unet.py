"""DDPM training of a small U-Net on 64x64 images with an EMA model and bf16 autocast."""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class UNet(nn.Module):
    def __init__(self, ch=128, mults=(1, 2, 2, 4)):
        super().__init__()
        tdim = ch * 4
        self.ch = ch
        self.time_mlp = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        chans = [ch * m for m in mults]
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        prev = ch
        for c in chans:
            self.down.append(ResBlock(prev, c, tdim))
            prev = c
        self.mid = ResBlock(prev, prev, tdim)
        for c in reversed(chans):
            self.up.append(ResBlock(prev + c, c, tdim))
            prev = c
        self.out = nn.Sequential(nn.GroupNorm(32, prev), nn.SiLU(), nn.Conv2d(prev, 3, 3, padding=1))

    def forward(self, x, t):
        emb = self.time_mlp(timestep_embedding(t, self.ch))
        h = self.inp(x)
        skips = []
        for blk in self.down:
            h = blk(h, emb)
            skips.append(h)
            h = F.avg_pool2d(h, 2)
        h = self.mid(h, emb)
        for blk in self.up:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = blk(torch.cat([h, skips.pop()], dim=1), emb)
        return self.out(h)


def linear_beta_schedule(T=1000):
    betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
    return torch.cumprod(1.0 - betas, dim=0).float()


def train(model: UNet, ema, loader, optimizer, scaler, alphas_bar, device, std_weight=0.0, ema_decay=0.9999):
    model.train()
    for batch in loader:
        x0 = batch.to(device, dtype=torch.bfloat16)  # expect: AMP001
        t = torch.randint(0, alphas_bar.numel(), (x0.size(0),), device=device)
        a = alphas_bar.to(device)[t].view(-1, 1, 1, 1)
        noise = torch.randn_like(x0)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x_t, t)
            loss = F.mse_loss(pred.float(), noise.float())
            std_reg = (pred.std(dim=(1, 2, 3)) - 1.0).abs().sum()  # expect: AMP004
            loss = loss + std_weight * std_reg
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 1.0 - ema_decay)


@torch.no_grad()
def sample(ema, alphas_bar, n=16, size=64, device="cuda"):
    betas = 1 - alphas_bar / torch.cat([alphas_bar.new_ones(1), alphas_bar[:-1]])
    x = torch.randn(n, 3, size, size, device=device)
    for i in reversed(range(alphas_bar.numel())):
        t = torch.full((n,), i, device=device, dtype=torch.long)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eps = ema(x, t).float()
        a, b = alphas_bar[i].item(), betas[i].item()
        x = (x - b / math.sqrt(1 - a) * eps) / math.sqrt(1 - b)
        if i > 0:
            x = x + math.sqrt(b) * torch.randn_like(x)
    return x.clamp(-1, 1)


def main(loader, epochs=500, device="cuda"):
    model = UNet().to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    alphas_bar = linear_beta_schedule()
    for epoch in range(epochs):
        train(model, ema, loader, optimizer, scaler, alphas_bar, device)
        if epoch % 20 == 0:
            torch.save(sample(ema, alphas_bar), f"samples_{epoch}.pt")
            torch.save({"ema": copy.deepcopy(ema).half().state_dict(), "model": model.state_dict()}, "ddpm.pt")
