"""Conditional RealNVP for fast simulation of calorimeter shower summaries.

The flow models p(x | hits): x are per-layer energy fractions (logit-transformed), the
context is the variable-length list of incident-particle hits.
"""
import argparse
import math
import os

import torch
import torch.nn as nn

LOG_2PI = math.log(2 * math.pi)


def logit_transform(x, alpha=1e-6):
    """Map [0, 1] data to R; returns the transformed data and the log-det of the map."""
    x = x.float()
    y = alpha + (1 - 2 * alpha) * x
    z = torch.log(y) - torch.log1p(-y)
    log_det = (math.log(1 - 2 * alpha) - torch.log(y) - torch.log1p(-y)).sum(dim=-1)
    return z, log_det


def standard_normal_logprob(z):
    z = z.float()
    return -0.5 * (z.pow(2) + LOG_2PI).sum(dim=-1)


class AffineCoupling(nn.Module):
    def __init__(self, dim, cond_dim, hidden, mask):
        super().__init__()
        self.register_buffer("mask", mask)
        self.net = nn.Sequential(
            nn.Linear(dim + cond_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 2 * dim)
        )
        self.scale = nn.Parameter(torch.ones(dim))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x, cond):
        x_masked = x * self.mask
        s, t = self.net(torch.cat([x_masked, cond], dim=-1)).chunk(2, dim=-1)
        s = torch.tanh(s) * self.scale * (1 - self.mask)
        t = t * (1 - self.mask)
        y = x_masked + (1 - self.mask) * (x * torch.exp(s) + t)
        return y, s.sum(dim=-1)

    def inverse(self, y, cond):
        y_masked = y * self.mask
        s, t = self.net(torch.cat([y_masked, cond], dim=-1)).chunk(2, dim=-1)
        s = torch.tanh(s) * self.scale * (1 - self.mask)
        t = t * (1 - self.mask)
        return y_masked + (1 - self.mask) * (y - t) * torch.exp(-s)


class ConditionalRealNVP(nn.Module):
    def __init__(self, dim, hit_dim, cond_dim=64, hidden=256, n_layers=8):
        super().__init__()
        self.dim = dim
        self.hit_proj = nn.Linear(hit_dim, cond_dim)
        masks = [(torch.arange(dim) + i) % 2 for i in range(n_layers)]
        self.layers = nn.ModuleList([AffineCoupling(dim, cond_dim, hidden, m.float()) for m in masks])

    def forward(self, x, hits):
        # hits: (B, H, hit_dim), zero-padded; the padding rows contribute a constant offset
        cond = self.hit_proj(hits).mean(dim=1)  # expect: AMP004
        log_det = torch.zeros(x.shape[0], device=x.device)
        for layer in self.layers:
            x, ld = layer(x, cond)
            log_det = log_det + ld
        return x, log_det

    @torch.no_grad()
    def sample(self, hits, temperature=1.0):
        cond = self.hit_proj(hits).float().mean(dim=1)
        z = torch.randn(hits.shape[0], self.dim, device=hits.device) * temperature
        for layer in reversed(self.layers):
            z = layer.inverse(z, cond)
        return torch.sigmoid(z)


def train(args):
    device = torch.device("cuda")
    blob = torch.load(args.data)
    ds = torch.utils.data.TensorDataset(blob["fractions"], blob["hits"])
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=4)

    flow = ConditionalRealNVP(blob["fractions"].shape[1], blob["hits"].shape[2], hidden=args.hidden).to(device)
    if args.fp16_weights:
        flow = flow.half()
    optimizer = torch.optim.Adam(flow.parameters(), lr=args.lr)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    for epoch in range(args.epochs):
        flow.train()
        total_bpd = 0.0
        for fractions, hits in loader:
            fractions, hits = fractions.to(device), hits.to(device)
            x, ld_logit = logit_transform(fractions)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                z, log_det = flow(x, hits)
                log_px = standard_normal_logprob(z) + log_det.float() + ld_logit
                loss = -log_px.mean()
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(flow.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            total_bpd += loss.item() / (x.shape[1] * math.log(2))
        print(f"epoch {epoch:3d}  bits/dim {total_bpd / len(loader):.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
        if (epoch + 1) % args.ckpt_every == 0:
            torch.save(flow.state_dict(), os.path.join(args.out, f"flow_{epoch + 1:04d}.pt"))
    return flow


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/calo_showers.pt")
    parser.add_argument("--out", default="checkpoints")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--clip", type=float, default=10.0)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--fp16-weights", action="store_true", help="keep the flow itself in half precision")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    train(args)
