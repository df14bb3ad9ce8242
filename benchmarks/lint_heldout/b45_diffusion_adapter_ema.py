"""Train a ControlNet-style condition adapter on top of a frozen latent-diffusion UNet, with EMA.

    python b45_diffusion_adapter_ema.py --unet ckpt/unet.pt --data latents/ --mixed_precision fp16
"""
import argparse
import copy
import math
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, ch, t_dim):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(32, ch), nn.GroupNorm(32, ch)
        self.conv1, self.conv2 = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv2d(ch, ch, 3, padding=1)
        self.t_proj = nn.Linear(t_dim, ch)

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x))) + self.t_proj(temb)[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h)))


class TinyUNet(nn.Module):
    def __init__(self, in_ch=4, ch=128, t_dim=512, depth=4):
        super().__init__()
        self.t_dim = t_dim
        self.t_mlp = nn.Sequential(nn.Linear(t_dim, t_dim), nn.SiLU(), nn.Linear(t_dim, t_dim))
        self.conv_in = nn.Conv2d(in_ch, ch, 3, padding=1)
        self.blocks = nn.ModuleList([ResBlock(ch, t_dim) for _ in range(depth)])
        self.conv_out = nn.Sequential(nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, in_ch, 3, padding=1))

    def forward(self, x, t, control=None):
        temb = self.t_mlp(timestep_embedding(t, self.t_dim))
        h = self.conv_in(x)
        for i, block in enumerate(self.blocks):
            h = block(h, temb)
            if control is not None:
                h = h + control[i]
        return self.conv_out(h)


class ConditionAdapter(nn.Module):
    """Encodes a condition map (edges/depth at latent resolution) into one residual per UNet block."""

    def __init__(self, cond_ch=3, ch=128, depth=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(cond_ch, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, ch, 3, padding=1), nn.SiLU())
        self.zero_convs = nn.ModuleList([nn.Conv2d(ch, ch, 1) for _ in range(depth)])
        for conv in self.zero_convs:
            nn.init.zeros_(conv.weight), nn.init.zeros_(conv.bias)

    def forward(self, cond):
        h = self.encoder(cond)
        return [zc(h) for zc in self.zero_convs]


class DDPMSchedule:
    def __init__(self, num_steps=1000, beta_start=8.5e-4, beta_end=1.2e-2, device="cuda"):
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_steps, device=device) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.num_steps = num_steps

    def add_noise(self, x0, noise, t):
        a = self.alphas_cumprod[t].view(-1, 1, 1, 1)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise


class EMAModel:
    def __init__(self, model, decay=0.9999):
        self.decay, self.num_updates = decay, 0
        self.shadow = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def step(self, model):
        self.num_updates += 1
        decay = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        for s, p in zip(self.shadow.parameters(), model.parameters()):
            s.mul_(decay).add_(p.detach(), alpha=1 - decay)

    def state_dict(self):
        return {"shadow": self.shadow.state_dict(), "num_updates": self.num_updates}

    def load_state_dict(self, state):
        self.shadow.load_state_dict(state["shadow"])
        self.num_updates = state["num_updates"]


def setup_models(args, device):
    unet = TinyUNet()
    unet.load_state_dict(torch.load(args.unet, map_location="cpu"))
    unet.requires_grad_(False)
    unet.to(device, dtype=torch.float16)
    adapter = ConditionAdapter()
    adapter = adapter.to(device, dtype=torch.float16)  # expect: AMP001
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=1e-2)  # expect: AMP011
    ema = EMAModel(adapter, decay=args.ema_decay)
    return unet, adapter, optimizer, ema


@torch.no_grad()
@torch.cuda.amp.autocast()  # expect: AMP009
def log_validation(unet, ema, schedule, cond, steps=50):
    x = torch.randn(cond.size(0), 4, cond.size(2), cond.size(3), device=cond.device)
    control = ema.shadow(cond)
    for t in torch.linspace(schedule.num_steps - 1, 0, steps, device=cond.device).long():
        eps = unet(x, t.repeat(x.size(0)), control=control)
        a = schedule.alphas_cumprod[t]
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        a_prev = schedule.alphas_cumprod[max(int(t) - schedule.num_steps // steps, 0)]
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return x.float()


def save_state(path, adapter, ema, optimizer, lr_scheduler, step):
    torch.save({"adapter": adapter.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(), "step": step}, path)


def export_adapter_fp16(ema, path):
    torch.save({k: v.to(torch.float16) for k, v in ema.shadow.state_dict().items()}, path)


def train(args):
    device = torch.device("cuda")
    unet, adapter, optimizer, ema = setup_models(args, device)
    schedule = DDPMSchedule(device=device)
    data = torch.load(os.path.join(args.data, "latents.pt"))  # latents (N, 4, 32, 32) fp32, cond (N, 3, 32, 32)
    loader = DataLoader(TensorDataset(data["latents"], data["cond"]), batch_size=args.batch_size, shuffle=True, drop_last=True)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "no": torch.float32}[args.mixed_precision]
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.mixed_precision == "fp16" else nullcontext()  # expect: AMP010

    step = 0
    if args.resume:
        state = torch.load(args.resume, map_location=device)
        adapter.load_state_dict(state["adapter"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        step = state["step"]

    adapter.train()
    while step < args.max_steps:
        for latents, cond in loader:
            latents, cond = latents.to(device, non_blocking=True), cond.to(device, dtype=weight_dtype)
            noise = torch.randn_like(latents)
            t = torch.randint(0, schedule.num_steps, (latents.size(0),), device=device)
            noisy = schedule.add_noise(latents, noise, t).to(weight_dtype)
            with ctx:
                noise_pred = unet(noisy, t, control=adapter(cond))
                loss = F.mse_loss(noise_pred.float(), noise.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ema.step(adapter)
            step += 1
            if step % args.val_every == 0:
                samples = log_validation(unet, ema, schedule, cond[:4])
                torch.save(samples.cpu(), os.path.join(args.out_dir, f"val_{step:06d}.pt"))
                save_state(os.path.join(args.out_dir, "state.pt"), adapter, ema, optimizer, lr_scheduler, step)
            if step >= args.max_steps:
                break
    export_adapter_fp16(ema, os.path.join(args.out_dir, "adapter_ema_fp16.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--unet", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out_dir", default="out-adapter")
    p.add_argument("--resume", default="")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--max_steps", type=int, default=50_000)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--val_every", type=int, default=1000)
    train(p.parse_args())
