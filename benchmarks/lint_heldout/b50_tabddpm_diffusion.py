"""TabDDPM-style diffusion for mixed numerical / categorical tables.

Gaussian diffusion on quantile-normalised numerical columns, multinomial diffusion on
one-hot categorical columns, plus a missingness head for the numerical part.
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def load_table(path):
    data = np.load(path)
    x_num = data["x_num"].astype(np.float32)
    mu, sd = x_num.mean(0), x_num.std(0)
    x_num = (x_num - mu) / (sd + 1e-8)
    x_cat = data["x_cat"].astype(np.int64)
    cat_sizes = [int(x_cat[:, j].max()) + 1 for j in range(x_cat.shape[1])]
    miss = np.isnan(data["x_num"]).astype(np.float32)
    return np.nan_to_num(x_num), x_cat, miss, cat_sizes


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPDiffusion(nn.Module):
    def __init__(self, d_in, d_out, d_hidden=512, n_layers=4, dim_t=128, dropout=0.0):
        super().__init__()
        self.dim_t = dim_t
        self.proj = nn.Linear(d_in, dim_t)
        self.time_embed = nn.Sequential(nn.Linear(dim_t, dim_t), nn.SiLU(), nn.Linear(dim_t, dim_t))
        layers, d = [], dim_t
        for _ in range(n_layers):
            layers += [nn.Linear(d, d_hidden), nn.ReLU(), nn.Dropout(dropout)]
            d = d_hidden
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x, t):
        emb = self.time_embed(timestep_embedding(t, self.dim_t))
        h = self.proj(x) + emb
        return self.head(self.blocks(h))


def index_to_log_onehot(x_cat, cat_sizes):
    parts = [F.one_hot(x_cat[:, j], k) for j, k in enumerate(cat_sizes)]
    onehot = torch.cat(parts, dim=1).float()
    return torch.log(onehot.clamp(min=1e-30))


def multinomial_kl(log_x0, logits, cat_sizes):
    logits = logits.float()
    kl, start = 0.0, 0
    for k in cat_sizes:
        log_pred = F.log_softmax(logits[:, start:start + k], dim=-1)
        log_true = log_x0[:, start:start + k]
        kl = kl + (log_true.exp() * (log_true - log_pred)).sum(-1)
        start += k
    return kl.mean() / len(cat_sizes)


def q_sample_cat(log_x0, alpha_bar, cat_sizes):
    probs, start = [], 0
    for k in cat_sizes:
        p = alpha_bar[:, None] * log_x0[:, start:start + k].exp() + (1 - alpha_bar[:, None]) / k
        probs.append(torch.log(p.clamp(min=1e-30)))
        start += k
    return torch.cat(probs, dim=1)


def train(args):
    device = torch.device("cuda")
    x_num, x_cat, miss, cat_sizes = load_table(args.data)
    n_num, n_cat = x_num.shape[1], sum(cat_sizes)
    x_num, x_cat, miss = (torch.from_numpy(a).to(device) for a in (x_num, x_cat, miss))

    model = MLPDiffusion(n_num + n_cat, 2 * n_num + n_cat).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    betas = torch.linspace(1e-4, 0.02, args.timesteps, device=device)
    alphas_bar = torch.cumprod(1.0 - betas, dim=0)
    best_loss = 1e9

    for step in range(args.steps):
        idx = torch.randint(0, x_num.shape[0], (args.batch_size,), device=device)
        xn, xc, m = x_num[idx], x_cat[idx], miss[idx]
        t = torch.randint(0, args.timesteps, (xn.shape[0],), device=device)
        a = alphas_bar[t]
        noise = torch.randn_like(xn)
        xn_t = a.sqrt()[:, None] * xn + (1 - a).sqrt()[:, None] * noise
        log_x0 = index_to_log_onehot(xc, cat_sizes)
        log_xt = q_sample_cat(log_x0, a, cat_sizes)

        with torch.autocast("cuda", dtype=torch.float16):
            out = model(torch.cat([xn_t, log_xt.exp()], dim=1), t)
            eps_pred = out[:, :n_num]
            cat_logits = out[:, n_num:n_num + n_cat]
            miss_prob = torch.sigmoid(out[:, n_num + n_cat:])
            loss_multi = multinomial_kl(log_x0, cat_logits, cat_sizes)
            log_keep = torch.log(miss_prob + 1e-8)  # expect: AMP011
            loss_miss = -(m * log_keep).sum() / (m.shape[0] * n_num)
            pred_spread = eps_pred.detach().std(dim=0)  # expect: AMP004
        loss_gauss = F.mse_loss(eps_pred, noise)  # expect: AMP002
        loss = loss_gauss + loss_multi + 0.1 * loss_miss

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()

        if step % args.log_every == 0:
            cur = loss.item()
            best_loss = min(best_loss, cur)
            print(f"step {step} loss {cur:.4f} best {best_loss:.4f} spread {pred_spread.max().item():.3f}")
    return model


@torch.no_grad()
def sample(model, n, n_num, cat_sizes, timesteps, device="cuda"):
    model.eval()
    xn = torch.randn(n, n_num, device=device)
    log_xc = torch.full((n, sum(cat_sizes)), -math.log(2.0), device=device)
    betas = torch.linspace(1e-4, 0.02, timesteps, device=device)
    alphas = 1.0 - betas
    alphas_bar = torch.cumprod(alphas, dim=0)
    for i in reversed(range(timesteps)):
        t = torch.full((n,), i, device=device, dtype=torch.long)
        out = model(torch.cat([xn, log_xc.exp()], dim=1), t).float()
        eps = out[:, :n_num]
        xn = (xn - betas[i] / (1 - alphas_bar[i]).sqrt() * eps) / alphas[i].sqrt()
        if i > 0:
            xn = xn + betas[i].sqrt() * torch.randn_like(xn)
        log_xc = F.log_softmax(out[:, n_num:n_num + sum(cat_sizes)], dim=-1)
    return xn.cpu().numpy(), log_xc.argmax(-1).cpu().numpy()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--timesteps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=100)
    train(p.parse_args())
