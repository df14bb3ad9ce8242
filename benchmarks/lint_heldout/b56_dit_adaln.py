"""Latent diffusion transformer (DiT-B/2 style) with adaLN-Zero modulation, QK-RMSNorm,
an auxiliary class head on pooled tokens, and EMA. fp16 autocast with a GradScaler."""
import math
from copy import deepcopy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq_dim=256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

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
        self.num_classes, self.dropout_prob = num_classes, dropout_prob

    def forward(self, labels, train):
        if train and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, self.num_classes, labels)
        return self.table(labels)


class QKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-8) * self.weight  # expect: AMP004, AMP011


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = QKNorm(dim // heads), QKNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.norm2 = RMSNorm(hidden)
        h = int(hidden * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(hidden, h), nn.GELU(approximate="tanh"), nn.Linear(h, hidden))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden, patch, out_ch):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, patch * patch * out_ch)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))


def sincos_pos_embed(dim, grid):
    gh, gw = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4.0))
    out = [np.sin(np.outer(g.reshape(-1), omega)) for g in (gh, gw)] + [np.cos(np.outer(g.reshape(-1), omega)) for g in (gh, gw)]
    return torch.from_numpy(np.concatenate(out, axis=1)).float().unsqueeze(0)


class DiT(nn.Module):
    def __init__(self, input_size=32, patch=2, in_ch=4, hidden=768, depth=12, heads=12, num_classes=1000,
                 class_dropout_prob=0.1, learn_sigma=True):
        super().__init__()
        self.in_ch, self.patch = in_ch, patch
        self.out_ch = in_ch * 2 if learn_sigma else in_ch
        self.x_embedder = nn.Conv2d(in_ch, hidden, patch, stride=patch)
        self.t_embedder = TimestepEmbedder(hidden)
        self.y_embedder = LabelEmbedder(num_classes, hidden, class_dropout_prob)
        self.register_buffer("pos_embed", sincos_pos_embed(hidden, input_size // patch))
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden, patch, self.out_ch)
        self.aux_proj = nn.Linear(hidden, hidden)
        self.aux_cls = nn.Linear(hidden, num_classes)

    def unpatchify(self, x):
        p, c = self.patch, self.out_ch
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y):
        x = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, self.training)
        for i, block in enumerate(self.blocks):
            x = block(x, c)
            if i == len(self.blocks) // 2:
                feat = self.aux_proj(x).mean(dim=1)  # expect: AMP004
                aux_logits = self.aux_cls(F.gelu(feat))
        out = self.unpatchify(self.final_layer(x, c))
        return out, aux_logits


def mean_flat(t):
    return t.mean(dim=list(range(1, t.ndim)))


class GaussianDiffusion:
    def __init__(self, steps=1000):
        betas = np.linspace(1e-4, 0.02, steps, dtype=np.float64)
        alphas_cumprod = np.cumprod(1.0 - betas)
        self.num_timesteps = steps
        self.sqrt_ac = torch.tensor(np.sqrt(alphas_cumprod), dtype=torch.float32)
        self.sqrt_1mac = torch.tensor(np.sqrt(1.0 - alphas_cumprod), dtype=torch.float32)

    def q_sample(self, x0, t, noise):
        a = self.sqrt_ac.to(x0.device)[t].view(-1, 1, 1, 1)
        s = self.sqrt_1mac.to(x0.device)[t].view(-1, 1, 1, 1)
        return a * x0 + s * noise

    def training_losses(self, model, x0, t, y):
        noise = torch.randn_like(x0)
        x_t = self.q_sample(x0, t, noise)
        out, aux_logits = model(x_t, t, y)
        eps_pred, var_values = out.chunk(2, dim=1)
        mse = mean_flat((noise - eps_pred) ** 2)
        var_reg = mean_flat(torch.tanh(var_values).float() ** 2)
        aux = F.cross_entropy(aux_logits, y, reduction="none")
        s = self.sqrt_1mac.to(x0.device)[t].view(-1, 1, 1, 1)
        x0_pred = (x_t - s * eps_pred) / (self.sqrt_ac.to(x0.device)[t].view(-1, 1, 1, 1) + 1e-8)
        return {"loss": mse + 1e-3 * var_reg + 0.1 * aux, "mse": mse, "x0_err": mean_flat((x0_pred - x0).abs())}


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    for ema_p, p in zip(ema.parameters(), model.parameters()):
        ema_p.mul_(decay).add_(p.detach(), alpha=1 - decay)


def train(loader, vae, steps=400_000, accum=2, device="cuda"):
    model = DiT().to(device)
    ema = deepcopy(model).requires_grad_(False)
    vae = vae.to(device).eval().requires_grad_(False).half()
    diffusion = GaussianDiffusion()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda")
    step = 0
    model.train()
    while step < steps:
        for i, (img, y) in enumerate(loader):
            img, y = img.to(device), y.to(device)
            with torch.no_grad():
                x0 = vae.encode(img.half()).latent_dist.sample().float().mul_(0.18215)
            t = torch.randint(0, diffusion.num_timesteps, (x0.shape[0],), device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                terms = diffusion.training_losses(model, x0, t, y)
                loss = terms["loss"].mean() / accum
                scaler.scale(loss).backward()  # expect: AMP008
            if (i + 1) % accum == 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                update_ema(ema, model)
                step += 1
                if step % 100 == 0:
                    print(f"step {step} loss {loss.item() * accum:.4f} mse {terms['mse'].mean().item():.4f}")
    return model, ema
