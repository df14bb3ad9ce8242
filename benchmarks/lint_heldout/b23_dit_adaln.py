"""DiT-S/2 with adaLN-Zero conditioning and caption cross-attention, trained on VAE latents."""
import argparse
import math
from contextlib import nullcontext
from copy import deepcopy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def sincos_2d(dim, grid):
    gh, gw = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4.0))
    out = [np.sin(np.outer(g.reshape(-1), omega)) for g in (gh, gw)] + [np.cos(np.outer(g.reshape(-1), omega)) for g in (gh, gw)]
    return torch.from_numpy(np.concatenate(out, axis=1)).float().unsqueeze(0)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.freq_dim = freq_dim

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.freq_dim))


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes, hidden, dropout_prob):
        super().__init__()
        self.table = nn.Embedding(num_classes + 1, hidden)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels):
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.table(labels)


class CaptionProjector(nn.Module):
    def __init__(self, txt_dim, dim):
        super().__init__()
        self.fc1 = nn.Linear(txt_dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.pool = nn.Linear(dim, dim)

    def forward(self, txt):
        h = self.fc2(F.gelu(self.fc1(txt), approximate="tanh"))
        pooled = self.pool(h.mean(dim=1))  # expect: AMP004
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + 1e-8)
        return h, pooled


class QKNorm(nn.Module):
    """RMS normalisation of queries and keys; keeps attention logits bounded at scale."""

    def __init__(self, head_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x):
        ms = (x * x).mean(dim=-1, keepdim=True)  # expect: AMP004
        return x * torch.rsqrt(ms + 1e-10) * self.weight  # expect: AMP011


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = QKNorm(dim // heads)
        self.k_norm = QKNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class CrossAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim * 2)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cap, cap_mask):
        B, N, C = x.shape
        h = self.heads
        q = self.q(x).view(B, N, h, C // h).transpose(1, 2)
        k, v = self.kv(cap).view(B, cap.shape[1], 2, h, C // h).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.masked_fill(~cap_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class DiTBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(dim, heads)
        self.norm_x = nn.LayerNorm(dim, eps=1e-6)
        self.cross = CrossAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c, cap, cap_mask):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + self.cross(self.norm_x(x), cap, cap_mask)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, dim, patch, out_ch):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch * patch * out_ch)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, input_size=32, patch=2, in_ch=4, dim=384, depth=12, heads=6,
                 num_classes=1000, txt_dim=768, class_dropout=0.1, learn_sigma=True):
        super().__init__()
        self.out_ch = in_ch * 2 if learn_sigma else in_ch
        self.patch = patch
        self.x_embed = nn.Conv2d(in_ch, dim, patch, stride=patch)
        self.t_embed = TimestepEmbedder(dim)
        self.y_embed = LabelEmbedder(num_classes, dim, class_dropout)
        self.cap_proj = CaptionProjector(txt_dim, dim)
        self.register_buffer("pos_embed", sincos_2d(dim, input_size // patch))
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.final = FinalLayer(dim, patch, self.out_ch)
        for mod in [blk.adaLN_modulation[-1] for blk in self.blocks] + [self.final.adaLN_modulation[-1], self.final.linear]:
            nn.init.zeros_(mod.weight)
            nn.init.zeros_(mod.bias)

    def unpatchify(self, x):
        c, p = self.out_ch, self.patch
        h = w = int(x.shape[1] ** 0.5)
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(x.shape[0], h, w, p, p, c))
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y, txt, txt_mask):
        x = self.x_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        cap, pooled = self.cap_proj(txt)
        c = self.t_embed(t) + self.y_embed(y) + pooled
        for blk in self.blocks:
            x = blk(x, c, cap, txt_mask)
        return self.unpatchify(self.final(x, c))


class DiffusionSchedule:
    def __init__(self, T, device):
        self.T = T
        betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.sqrt_ab, self.sqrt_1mab = alphas_cumprod.sqrt().float().to(device), (1.0 - alphas_cumprod).sqrt().float().to(device)
        self.alphas, self.betas = (1.0 - betas).float().to(device), betas.float().to(device)

    def q_sample(self, x0, t, noise):
        return self.sqrt_ab[t].view(-1, 1, 1, 1) * x0 + self.sqrt_1mab[t].view(-1, 1, 1, 1) * noise


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    for ema_p, p in zip(ema.parameters(), model.parameters()):
        ema_p.mul_(decay).add_(p.detach(), alpha=1 - decay)


@torch.no_grad()
def sample(model, sched, labels, txt, txt_mask, cfg_scale=4.0, shape=(4, 32, 32)):
    x = torch.randn(labels.shape[0], *shape, device=labels.device)
    null = torch.full_like(labels, 1000)
    for i in reversed(range(sched.T)):
        t = torch.full((labels.shape[0],), i, device=labels.device, dtype=torch.long)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([labels, null]),
                        torch.cat([txt, txt]), torch.cat([txt_mask, txt_mask]))
        eps_c, eps_u = out.float()[:, : shape[0]].chunk(2)
        eps = eps_u + cfg_scale * (eps_c - eps_u)
        a, ab, b = sched.alphas[i], sched.sqrt_ab[i] ** 2, sched.betas[i]
        x = (x - b / torch.sqrt(1 - ab) * eps) / torch.sqrt(a)
        if i > 0:
            x = x + torch.sqrt(b) * torch.randn_like(x)
    return x


def train(args):
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    model = DiT(dim=args.dim, depth=args.depth, heads=args.heads).to(device)
    ema = deepcopy(model).requires_grad_(False)
    sched = DiffusionSchedule(args.num_steps, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    data = torch.load(args.latents)
    loader = DataLoader(list(zip(*data.values())), batch_size=args.batch_size, shuffle=True, drop_last=True)
    for epoch in range(args.epochs):
        model.train()
        for it, (latents, labels, txt, txt_mask) in enumerate(loader):
            latents = latents.to(device) * 0.18215
            labels, txt, txt_mask = labels.to(device), txt.to(device), txt_mask.to(device)
            t, noise = torch.randint(0, sched.T, (latents.shape[0],), device=device), torch.randn_like(latents)
            x_t = sched.q_sample(latents, t, noise)
            with amp_ctx:
                model_out = model(x_t, t, labels, txt, txt_mask)
            eps_pred, _ = model_out.split(latents.shape[1], dim=1)
            loss = F.mse_loss(eps_pred, noise)  # expect: AMP002
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            update_ema(ema, model)
            if it % args.log_every == 0:
                print(f"epoch {epoch} it {it:06d} loss {loss.item():.4f}")
        torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict()}, f"{args.out}/dit_{epoch:04d}.pt")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--latents", required=True)
    p.add_argument("--out", default="checkpoints")
    p.add_argument("--amp", action="store_true")
    defaults = {"dim": 384, "depth": 12, "heads": 6, "num_steps": 1000, "epochs": 80,
                "batch_size": 256, "lr": 1e-4, "log_every": 100, "seed": 0}
    for name, value in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    train(p.parse_args())
