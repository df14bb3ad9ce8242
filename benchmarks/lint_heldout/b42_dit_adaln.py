"""Latent diffusion transformer (DiT) with adaLN-Zero conditioning, QK-norm and a
REPA-style alignment head, trained with CUDA fp16 autocast behind a flag.
"""
import argparse
import copy
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_pos_embed(dim, grid):
    coords = torch.arange(grid, dtype=torch.float32)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    out = [torch.sin(xx.reshape(-1, 1) * omega), torch.cos(xx.reshape(-1, 1) * omega),
           torch.sin(yy.reshape(-1, 1) * omega), torch.cos(yy.reshape(-1, 1) * omega)]
    return torch.cat(out, dim=1)[None]


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq_dim=256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        return self.mlp(timestep_embedding(t, self.freq_dim))


class QKNorm(nn.Module):
    """RMS norm applied to per-head queries and keys."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-8) * self.weight  # expect: AMP004, AMP011


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.q_norm = QKNorm(self.head_dim)
        self.k_norm = QKNorm(self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.track_stats = False
        self.last_entropy = None
        self.last_out_std = None

    def forward(self, x):
        B, N, C = x.shape
        q = self.q_norm(self.to_q(x).view(B, N, self.heads, self.head_dim).transpose(1, 2))
        k = self.k_norm(self.to_k(x).view(B, N, self.heads, self.head_dim).transpose(1, 2))
        v = self.to_v(x).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        attn = attn.softmax(dim=-1)
        out = self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))
        if self.track_stats:
            with torch.no_grad():
                # softmax output is fp32 under CUDA autocast
                self.last_entropy = -(attn * torch.log(attn + 1e-8)).sum(-1).mean()
                self.last_out_std = out.std()  # expect: AMP004
        return out


class DiTBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, dim, patch, out_ch):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch * patch * out_ch)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, input_size=32, patch=2, in_ch=4, dim=768, depth=12, heads=12, num_classes=1000,
                 repa_depth=4, repa_dim=768):
        super().__init__()
        self.patch, self.in_ch, self.grid = patch, in_ch, input_size // patch
        self.x_embedder = nn.Conv2d(in_ch, dim, kernel_size=patch, stride=patch)
        self.t_embedder = TimestepEmbedder(dim)
        self.y_embedder = nn.Embedding(num_classes + 1, dim)   # last index = null class for CFG
        self.register_buffer("pos_embed", sincos_pos_embed(dim, self.grid))
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.final_layer = FinalLayer(dim, patch, in_ch)
        self.repa_depth = repa_depth
        self.repa_proj = nn.Sequential(nn.Linear(dim, 2048), nn.SiLU(), nn.Linear(2048, repa_dim))

    def unpatchify(self, x):
        p, c, h = self.patch, self.in_ch, self.grid
        x = x.reshape(x.shape[0], h, h, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, h * p)

    def forward(self, x, t, y):
        x = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        zs = None
        for i, block in enumerate(self.blocks):
            x = block(x, c)
            if i + 1 == self.repa_depth:
                zs = F.normalize(self.repa_proj(x), dim=-1)
        return self.unpatchify(self.final_layer(x, c)), zs


class GaussianDiffusion:
    def __init__(self, T=1000):
        betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.sqrt_ab = alphas_cumprod.sqrt().float()
        self.sqrt_1mab = (1.0 - alphas_cumprod).sqrt().float()
        self.T = T

    def q_sample(self, x0, t, noise):
        a = self.sqrt_ab.to(x0.device)[t].view(-1, 1, 1, 1)
        s = self.sqrt_1mab.to(x0.device)[t].view(-1, 1, 1, 1)
        return a * x0 + s * noise


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    for p_ema, p in zip(ema.parameters(), model.parameters()):
        p_ema.mul_(decay).add_(p.detach(), alpha=1 - decay)


def train(args, loader, teacher_feats_fn):
    device = "cuda"
    model = DiT(input_size=args.latent_size, num_classes=args.num_classes).to(device)
    ema = copy.deepcopy(model).half().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()
    for blk in model.blocks:
        blk.attn.track_stats = args.log_attn_stats
    fwd = torch.compile(model) if args.compile else model
    diffusion = GaussianDiffusion(args.num_timesteps)
    step = 0
    for epoch in range(args.epochs):
        for i, (latents, y, images) in enumerate(loader):
            latents = latents.to(device, non_blocking=True) * 0.18215
            y = y.to(device)
            drop = torch.rand(y.shape[0], device=device) < args.cfg_dropout
            y = torch.where(drop, torch.full_like(y, args.num_classes), y)
            t = torch.randint(0, diffusion.T, (latents.shape[0],), device=device)
            noise = torch.randn_like(latents)
            x_t = diffusion.q_sample(latents, t, noise)
            with torch.no_grad():
                target_feats = F.normalize(teacher_feats_fn(images.to(device)), dim=-1)
            with ctx:
                model_out, zs = fwd(x_t, t, y)
                repa_loss = -(zs * target_feats).sum(dim=-1).mean()
            loss = F.mse_loss(noise, model_out) + args.repa_weight * repa_loss  # expect: AMP002
            scaler.scale(loss / args.accum).backward()
            if (i + 1) % args.accum == 0:
                scaler.unscale_(opt)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                update_ema(ema, model)
                step += 1
                if step % args.log_every == 0:
                    print(f"step {step} loss {loss.item():.4f} repa {repa_loss.item():.4f} |g| {grad_norm:.3f}")
                    if args.log_attn_stats:
                        ent = [round(b.attn.last_entropy.item(), 3) for b in model.blocks]
                        std = [round(b.attn.last_out_std.item(), 3) for b in model.blocks]
                        print(f"  attn entropy {ent}\n  attn out std {std}")
        torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "args": vars(args)}, f"dit_{epoch}.pt")
    return ema


@torch.no_grad()
def sample(model, y, steps=250, guidance=4.0, latent_size=32, device="cuda"):
    model.eval()
    x = torch.randn(y.shape[0], 4, latent_size, latent_size, device=device)
    null = torch.full_like(y, model.y_embedder.num_embeddings - 1)
    for t in reversed(range(0, 1000, 1000 // steps)):
        tt = torch.full((y.shape[0],), t, device=device, dtype=torch.long)
        with torch.autocast("cuda", dtype=torch.float16):
            eps_c, _ = model(x, tt, y)
            eps_u, _ = model(x, tt, null)
        eps = eps_u + guidance * (eps_c - eps_u)
        x = x - eps.float() * (1.0 / steps)  # schematic update; the real sampler lives in diffusion.py
    return x


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--latent-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--num-timesteps", type=int, default=1000)
    p.add_argument("--cfg-dropout", type=float, default=0.1)
    p.add_argument("--repa-weight", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--log-attn-stats", action="store_true")
    p.add_argument("--data", default="latents_imagenet256.pt")
    p.add_argument("--batch-size", type=int, default=256)
    return p.parse_args()


def main():
    args = parse_args()
    data = torch.load(args.data)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size // args.accum, shuffle=True,
                                         num_workers=8, drop_last=True)
    teacher = torch.hub.load("facebookresearch/dinov2", "dinov2_vitb14").cuda().eval().requires_grad_(False)

    def teacher_feats(images):
        return teacher.forward_features(images)["x_norm_patchtokens"]

    ema = train(args, loader, teacher_feats)
    y = torch.arange(8, device="cuda")
    torch.save(sample(ema.float(), y, latent_size=args.latent_size), "samples.pt")


if __name__ == "__main__":
    main()
