"""Text-conditioned latent diffusion (DDPM training, DDIM sampling) on pre-encoded VAE latents."""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def cosine_beta_schedule(timesteps, s=0.008):
    steps = timesteps + 1
    x = torch.linspace(0, timesteps, steps, dtype=torch.float64)
    alphas_cumprod = torch.cos(((x / timesteps) + s) / (1 + s) * math.pi * 0.5) ** 2
    alphas_cumprod = alphas_cumprod / alphas_cumprod[0]
    betas = 1 - (alphas_cumprod[1:] / alphas_cumprod[:-1])
    return torch.clip(betas, 0, 0.999)


class GaussianDiffusion(nn.Module):
    def __init__(self, timesteps=1000):
        super().__init__()
        betas = cosine_beta_schedule(timesteps)
        alphas = 1.0 - betas
        alphas_cumprod = torch.cumprod(alphas, dim=0)
        self.num_timesteps = timesteps
        self.register_buffer("alphas_cumprod", alphas_cumprod.float())
        self.register_buffer("sqrt_alphas_cumprod", alphas_cumprod.sqrt().float())
        self.register_buffer("sqrt_one_minus_alphas_cumprod", (1.0 - alphas_cumprod).sqrt().float())

    def q_sample(self, x0, t, noise):
        a = self.sqrt_alphas_cumprod[t].view(-1, 1, 1, 1)
        b = self.sqrt_one_minus_alphas_cumprod[t].view(-1, 1, 1, 1)
        return a * x0 + b * noise


class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, ch, emb_dim):
        super().__init__()
        self.norm1 = GroupNorm32(32, ch)
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.emb = nn.Linear(emb_dim, ch)
        self.norm2 = GroupNorm32(32, ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


class CrossAttention(nn.Module):
    def __init__(self, ch, ctx_dim, heads=8):
        super().__init__()
        self.heads = heads
        self.scale = (ch // heads) ** -0.5
        self.norm = GroupNorm32(32, ch)
        self.to_q = nn.Linear(ch, ch, bias=False)
        self.to_kv = nn.Linear(ctx_dim, 2 * ch, bias=False)
        self.to_out = nn.Linear(ch, ch)

    def forward(self, x, context, context_mask=None):
        b, c, hh, ww = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)
        q = self.to_q(tokens).view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        k = k.view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        if context_mask is not None:
            sim = sim.masked_fill(~context_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v).transpose(1, 2).reshape(b, -1, c)
        return x + self.to_out(out).transpose(1, 2).reshape(b, c, hh, ww)


class LatentUNet(nn.Module):
    """Deliberately small: one resolution, a stack of res/attention blocks."""

    def __init__(self, in_ch=4, ch=256, depth=6, vocab=49408, ctx_dim=512):
        super().__init__()
        self.ch = ch
        self.tok_emb = nn.Embedding(vocab, ctx_dim)
        self.time_mlp = nn.Sequential(nn.Linear(ch, 4 * ch), nn.SiLU(), nn.Linear(4 * ch, 4 * ch))
        self.inp = nn.Conv2d(in_ch, ch, 3, padding=1)
        self.res = nn.ModuleList([ResBlock(ch, 4 * ch) for _ in range(depth)])
        self.attn = nn.ModuleList([CrossAttention(ch, ctx_dim) for _ in range(depth)])
        self.out_norm = GroupNorm32(32, ch)
        self.out = nn.Conv2d(ch, in_ch, 3, padding=1)

    def forward(self, x, t, tokens, token_mask):
        emb = self.time_mlp(timestep_embedding(t, self.ch))
        context = self.tok_emb(tokens)
        h = self.inp(x)
        for res, attn in zip(self.res, self.attn):
            h = attn(res(h, emb), context, token_mask)
        return self.out(F.silu(self.out_norm(h)))


class EMA:
    def __init__(self, model, decay=0.9999):
        self.decay = decay
        self.shadow = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_p, p in zip(self.shadow.parameters(), model.parameters()):
            ema_p.lerp_(p.detach(), 1.0 - self.decay)


def train(cfg, loader):
    device = torch.device("cuda")
    model = LatentUNet(ch=cfg.channels, depth=cfg.depth).to(device)
    diffusion = GaussianDiffusion(cfg.timesteps).to(device)
    ema = EMA(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda")
    # homoscedastic uncertainty weighting of the denoising loss (Kendall et al.)
    log_var = nn.Parameter(torch.zeros((), device=device))
    weight_opt = torch.optim.SGD([log_var], lr=cfg.weight_lr)

    step = 0
    for epoch in range(cfg.epochs):
        for latents, tokens, token_mask in loader:
            optimizer.zero_grad(set_to_none=True)
            weight_opt.zero_grad(set_to_none=True)
            x0 = latents.to(device, non_blocking=True).half() * cfg.latent_scale  # expect: AMP001
            tokens, token_mask = tokens.to(device), token_mask.to(device)
            t = torch.randint(0, diffusion.num_timesteps, (x0.shape[0],), device=device)
            noise = torch.randn_like(x0)
            x_t = diffusion.q_sample(x0, t, noise)
            if cfg.cond_drop > 0:
                keep = torch.rand(x0.shape[0], device=device) > cfg.cond_drop
                token_mask = token_mask & keep[:, None]
                token_mask[:, 0] = True
            with torch.autocast("cuda", dtype=torch.float16):
                eps_pred = model(x_t, t, tokens, token_mask)
            mse = F.mse_loss(eps_pred, noise)  # expect: AMP002
            loss = mse * torch.exp(-log_var) + log_var
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            weight_opt.step()  # expect: AMP006
            ema.update(model)
            step += 1
            if step % cfg.log_every == 0:
                print(f"ep {epoch} step {step} mse {mse.item():.4f} log_var {log_var.item():.3f} gnorm {grad_norm:.2f}")
    return model, ema, diffusion


@torch.no_grad()
def generate_samples(model, diffusion, tokens, token_mask, steps=50, eta=0.0):
    net = copy.deepcopy(model).half().eval()
    b = tokens.shape[0]
    x = torch.randn(b, 4, 32, 32, device=tokens.device, dtype=torch.float16)
    times = torch.linspace(diffusion.num_timesteps - 1, 0, steps, device=tokens.device).long()
    for i, t in enumerate(times):
        a_t = diffusion.alphas_cumprod[t]
        a_prev = diffusion.alphas_cumprod[times[i + 1]] if i + 1 < len(times) else torch.ones_like(a_t)
        eps = net(x, t.repeat(b), tokens, token_mask).float()
        x0_pred = ((x.float() - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-4, 4)
        sigma = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt()
        dir_xt = (1 - a_prev - sigma**2).sqrt() * eps
        x = (a_prev.sqrt() * x0_pred + dir_xt + sigma * torch.randn_like(eps)).half()
    return x.float()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--latents", default="data/latents_256.pt")
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--timesteps", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--cond-drop", type=float, default=0.1)
    p.add_argument("--latent-scale", type=float, default=0.18215)
    p.add_argument("--log-every", type=int, default=200)
    return p.parse_args()


if __name__ == "__main__":
    cfg = parse_args()
    data = torch.load(cfg.latents)
    dataset = torch.utils.data.TensorDataset(data["latents"], data["tokens"], data["token_mask"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    unet, ema, diffusion = train(cfg, loader)
    torch.save({"model": unet.state_dict(), "ema": ema.shadow.state_dict()}, "ldm.pt")
