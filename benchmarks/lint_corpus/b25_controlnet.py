"""ControlNet-style conditioning branch on a small latent-diffusion UNet.

The UNet is frozen; a trainable copy of its encoder reads a spatial hint
(edges, depth) and feeds zero-initialised residuals into the UNet decoder."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def zero_module(module):
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, c_in, c_out, t_dim, groups=8):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.t_proj = nn.Linear(t_dim, c_out)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, t_emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.t_proj(F.silu(t_emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class Encoder(nn.Module):
    def __init__(self, c_in=4, widths=(64, 128, 256), t_dim=256):
        super().__init__()
        self.t_dim = t_dim
        self.time_mlp = nn.Sequential(nn.Linear(t_dim, t_dim), nn.SiLU(), nn.Linear(t_dim, t_dim))
        self.conv_in = nn.Conv2d(c_in, widths[0], 3, padding=1)
        self.blocks = nn.ModuleList()
        self.downs = nn.ModuleList()
        c = widths[0]
        for w in widths:
            self.blocks.append(ResBlock(c, w, t_dim))
            self.downs.append(nn.Conv2d(w, w, 3, stride=2, padding=1))
            c = w
        self.mid = ResBlock(c, c, t_dim)

    def forward(self, x, t, hint=None):
        t_emb = self.time_mlp(timestep_embedding(t, self.t_dim))
        h = self.conv_in(x)
        if hint is not None:
            h = h + hint
        skips = []
        for block, down in zip(self.blocks, self.downs):
            h = block(h, t_emb)
            skips.append(h)
            h = down(h)
        return self.mid(h, t_emb), skips, t_emb


class TinyUNet(nn.Module):
    def __init__(self, c_in=4, widths=(64, 128, 256), t_dim=256):
        super().__init__()
        self.encoder = Encoder(c_in, widths, t_dim)
        self.ups = nn.ModuleList()
        self.dec = nn.ModuleList()
        rev = list(widths[::-1])
        c = rev[0]
        for w in rev:
            self.ups.append(nn.ConvTranspose2d(c, c, 4, stride=2, padding=1))
            self.dec.append(ResBlock(c + w, w, t_dim))
            c = w
        self.out_norm = nn.GroupNorm(8, c)
        self.out_conv = nn.Conv2d(c, c_in, 3, padding=1)

    def forward(self, x, t, control=None):
        h, skips, t_emb = self.encoder(x, t)
        if control is not None:
            h = h + control[-1]
            skips = [s + c for s, c in zip(skips, control[:-1])]
        for up, block in zip(self.ups, self.dec):
            h = block(torch.cat([up(h), skips.pop()], dim=1), t_emb)
        return self.out_conv(F.silu(self.out_norm(h)))


class HintEncoder(nn.Module):
    def __init__(self, c_hint=3, c_out=64):
        super().__init__()
        self.convs = nn.ModuleList([
            nn.Conv2d(c_hint, 16, 3, padding=1),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.Conv2d(64, 64, 3, stride=2, padding=1),
        ])
        self.proj = nn.Conv2d(64, c_out, 3, padding=1)
        zero_module(self.proj)

    def forward(self, hint):
        for conv in self.convs:
            hint = F.silu(conv(hint))
        return self.proj(hint)


class ControlNet(nn.Module):
    def __init__(self, c_in=4, widths=(64, 128, 256), t_dim=256, c_hint=3):
        super().__init__()
        self.encoder = Encoder(c_in, widths, t_dim)
        self.hint_encoder = HintEncoder(c_hint, widths[0])
        self.zero_convs = nn.ModuleList([zero_module(nn.Conv2d(w, w, 1)) for w in widths])
        self.mid_zero = zero_module(nn.Conv2d(widths[-1], widths[-1], 1))

    def forward(self, x, t, cond, scale=1.0):
        hint = self.hint_encoder(cond)
        hint = hint - hint.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        h, skips, _ = self.encoder(x, t, hint=hint)
        residuals = [zc(s) * scale for zc, s in zip(self.zero_convs, skips)]
        residuals.append(self.mid_zero(h) * scale)
        return residuals


def train(unet, controlnet, optimizer, loader, alphas_cumprod, steps=20000, device="cuda"):
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    controlnet.train()
    alphas_cumprod = alphas_cumprod.to(device)
    snr = alphas_cumprod / (1 - alphas_cumprod + 1e-8)
    step = 0
    while step < steps:
        for latents, cond in loader:
            latents, cond = latents.to(device), cond.to(device)
            noise = torch.randn_like(latents)
            t = torch.randint(0, alphas_cumprod.numel(), (latents.size(0),), device=device)
            a = alphas_cumprod[t].view(-1, 1, 1, 1)
            noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
            weight = torch.clamp(snr[t], max=5.0) / snr[t]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                residuals = controlnet(noisy, t, cond)
                noise_pred = unet(noisy, t, control=residuals)
                per_sample = F.mse_loss(noise_pred.float(), noise, reduction="none").mean(dim=(1, 2, 3))
                loss = (weight * per_sample).mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            pred_std = noise_pred.detach().std()  # expect: AMP004
            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} pred_std {pred_std.item():.3f}")
            step += 1
            if step >= steps:
                break


def main():
    device = "cuda"
    unet = TinyUNet()
    unet.load_state_dict(torch.load("tiny_unet_ldm.pt", map_location="cpu"))
    unet.requires_grad_(False)
    unet.to(device, dtype=torch.bfloat16)

    controlnet = ControlNet()
    controlnet.encoder.load_state_dict(unet.encoder.state_dict())
    controlnet = controlnet.to(device, dtype=torch.bfloat16)  # expect: AMP001
    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=1e-5, weight_decay=1e-2)

    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0).float()
    loader = torch.load("hint_latents.pt")
    train(unet, controlnet, optimizer, loader, alphas_cumprod)
    torch.save(controlnet.state_dict(), "controlnet.pt")


if __name__ == "__main__":
    main()
