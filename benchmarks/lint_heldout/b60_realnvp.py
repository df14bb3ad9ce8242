"""RealNVP density estimator for tabular data in [0, 1]^D.

Data are dequantised, logit-transformed, normalised by a data-initialised ActNorm and
pushed through masked affine couplings (Glow-style sigmoid scales).  The base density is
a standard normal on the first half of the latent and a Gaussian conditioned on the first
half for the second half.  The objective is the exact negative log-likelihood in bits per
dimension.  Mixed precision: fp16 autocast with loss scaling.
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

LOG2PI = math.log(2.0 * math.pi)


class MeanAbsNorm(nn.Module):
    """Per-sample scale normalisation for the coupling MLPs (no batch statistics, so each
    sample's transform does not depend on the rest of the batch)."""

    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, h):
        m = h.abs().mean(dim=-1, keepdim=True)  # expect: AMP004
        return self.gain * h / (m + 1e-8)  # expect: AMP011


class ActNorm(nn.Module):
    """Affine normalisation initialised from the first batch (Kingma & Dhariwal, 2018)."""

    def __init__(self, dim):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(dim))
        self.log_scale = nn.Parameter(torch.zeros(dim))
        self.register_buffer("initialised", torch.tensor(False))

    def forward(self, x):
        if not bool(self.initialised):
            with torch.no_grad():
                self.loc.data = -x.mean(dim=0)
                self.log_scale.data = -torch.log(x.std(dim=0) + 1e-6)
                self.initialised.fill_(True)
        y = (x + self.loc) * torch.exp(self.log_scale)
        return y, self.log_scale.sum().expand(x.size(0))

    def inverse(self, y):
        return y * torch.exp(-self.log_scale) - self.loc


class AffineCoupling(nn.Module):
    """y = x_a + (1 - m) * (x + shift) * sigmoid(s + 2); the Jacobian is diag(scale)."""

    def __init__(self, dim, hidden, mask):
        super().__init__()
        self.register_buffer("mask", mask)
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), MeanAbsNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), MeanAbsNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, 2 * dim),
        )

    def forward(self, x):
        x_a = x * self.mask
        shift, raw_scale = self.net(x_a).chunk(2, dim=-1)
        scale = torch.sigmoid(raw_scale + 2.0)
        inv = 1.0 - self.mask
        y = x_a + inv * (x + shift) * scale
        log_det = (inv * torch.log(scale + 1e-8)).sum(dim=-1)  # expect: AMP011
        return y, log_det

    def inverse(self, y):
        y_a = y * self.mask
        shift, raw_scale = self.net(y_a).chunk(2, dim=-1)
        scale = torch.sigmoid(raw_scale + 2.0)
        return y_a + (1.0 - self.mask) * (y / scale - shift)


class RealNVP(nn.Module):
    def __init__(self, dim, hidden=256, n_couplings=8):
        super().__init__()
        self.dim = dim
        self.d1 = dim // 2
        self.actnorm = ActNorm(dim)
        masks = []
        for i in range(n_couplings):
            m = torch.zeros(dim)
            m[i % 2::2] = 1.0
            masks.append(m)
        self.couplings = nn.ModuleList([AffineCoupling(dim, hidden, m) for m in masks])
        self.prior_net = nn.Sequential(
            nn.Linear(self.d1, hidden), nn.ReLU(), nn.Linear(hidden, 2 * (dim - self.d1))
        )

    def base_log_prob(self, z):
        z1, z2 = z[:, :self.d1], z[:, self.d1:]
        mean, raw_std = self.prior_net(z1).chunk(2, dim=-1)
        std = F.elu(raw_std) + 1.0 + 1e-8  # expect: AMP011
        lp1 = -0.5 * (z1.pow(2) + LOG2PI).sum(dim=-1)
        lp2 = (-0.5 * ((z2 - mean) / std).pow(2) - torch.log(std) - 0.5 * LOG2PI).sum(dim=-1)
        return lp1 + lp2

    def forward(self, x):
        z, log_det = self.actnorm(x)
        for layer in self.couplings:
            z, ld = layer(z)
            log_det = log_det + ld
        return self.base_log_prob(z) + log_det

    @torch.no_grad()
    def sample(self, n, device):
        z1 = torch.randn(n, self.d1, device=device)
        mean, raw_std = self.prior_net(z1).chunk(2, dim=-1)
        std = F.elu(raw_std) + 1.0
        z2 = mean + std * torch.randn_like(mean)
        z = torch.cat([z1, z2], dim=-1)
        for layer in reversed(self.couplings):
            z = layer.inverse(z)
        return self.actnorm.inverse(z)


def dequantise(x, n_bins=256):
    return (x * (n_bins - 1) + torch.rand_like(x)) / n_bins


def logit_transform(x, alpha=1e-6):
    """Map (0, 1) data to R; returns the transformed data and its log-Jacobian."""
    y = alpha + (1.0 - 2.0 * alpha) * x
    ly = torch.log(y) - torch.log1p(-y)
    log_det = (math.log(1.0 - 2.0 * alpha) - torch.log(y) - torch.log1p(-y)).sum(dim=-1)
    return ly, log_det


def bits_per_dim(log_px, dim):
    return -log_px / (dim * math.log(2.0))


@torch.no_grad()
def evaluate(model, batches, device):
    model.eval()
    total, n = 0.0, 0
    for x in batches:
        x = dequantise(x.to(device))
        y, ld = logit_transform(x)
        log_px = model(y) + ld
        total += bits_per_dim(log_px, model.dim).sum().item()
        n += x.size(0)
    model.train()
    return total / n


def train(args, train_data, val_data):
    device = torch.device("cuda")
    dim = train_data.shape[1]
    model = RealNVP(dim, args.hidden, args.couplings).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    data = torch.from_numpy(train_data.astype(np.float32))
    val = torch.from_numpy(val_data.astype(np.float32))
    best, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        perm = torch.randperm(data.size(0))
        running = 0.0
        for i in range(0, data.size(0), args.batch_size):
            x = dequantise(data[perm[i:i + args.batch_size]].to(device))
            y, ld_pre = logit_transform(x)
            with torch.autocast("cuda", dtype=torch.float16):
                log_px = model(y) + ld_pre
                loss = bits_per_dim(log_px, dim).mean()

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            running += loss.item() * x.size(0)
            if not torch.isfinite(grad_norm):
                print(f"epoch {epoch} batch {i}: skipped step (scale {scaler.get_scale():.0f})")
        scheduler.step()

        val_bpd = evaluate(model, val.split(1024), device)
        print(f"epoch {epoch}: train {running / data.size(0):.4f} bpd, val {val_bpd:.4f} bpd")
        if val_bpd < best - 1e-4:
            best, bad_epochs = val_bpd, 0
            torch.save(model.state_dict(), args.out)
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                break
    return best


def make_data(n=50000, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(n, 2))
    mix = np.tanh(latent @ rng.normal(size=(2, dim))) * 0.45 + 0.5
    noisy = mix + 0.02 * rng.normal(size=mix.shape)
    return np.clip(np.round(noisy * 255.0) / 256.0, 0.0, 255.0 / 256.0)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--couplings", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--out", default="realnvp.pt")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    data = make_data()
    split = int(0.9 * len(data))
    best = train(args, data[:split], data[split:])
    print(f"best val bpd {best:.4f}")
    model = RealNVP(data.shape[1], args.hidden, args.couplings).cuda()
    model.load_state_dict(torch.load(args.out))
    samples = model.sample(16, torch.device("cuda"))
    print(samples.cpu().numpy().round(3))


if __name__ == "__main__":
    main()
