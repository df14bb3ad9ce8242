"""Temporal convolutional autoencoder for multivariate sensor anomaly detection.

Runs on CPU servers next to the data historian, so training uses CPU autocast with
bfloat16. Windows are normalised with RevIN; anomaly scores are standardised
reconstruction errors with running statistics kept in buffers.
"""
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, TensorDataset

AEOutput = namedtuple("AEOutput", ["recon", "err", "z", "reg"])

CONFIGS = {
    "tcn_small": {"n_features": 38, "channels": [64, 64, 64, 64], "kernel": 3, "latent": 32, "dropout": 0.1},
    "tcn_large": {"n_features": 38, "channels": [128, 128, 128, 128, 128, 128], "kernel": 5, "latent": 64, "dropout": 0.2},
}


class RevIN(nn.Module):
    def __init__(self, n_features, eps=1e-8):
        super().__init__()
        self.eps = eps
        self.affine_w = nn.Parameter(torch.ones(1, n_features, 1))
        self.affine_b = nn.Parameter(torch.zeros(1, n_features, 1))

    def normalize(self, x):
        self.mu = x.mean(dim=-1, keepdim=True).detach()
        self.sigma = torch.sqrt(x.var(dim=-1, keepdim=True, unbiased=False) + 1e-8).detach()
        return (x - self.mu) / self.sigma * self.affine_w + self.affine_b

    def denormalize(self, y):
        y = (y - self.affine_b) / (self.affine_w + self.eps * self.eps)
        return y * self.sigma + self.mu


class TemporalBlock(nn.Module):
    def __init__(self, n_in, n_out, kernel, dilation, dropout):
        super().__init__()
        self.pad = (kernel - 1) * dilation
        self.conv1 = weight_norm(nn.Conv1d(n_in, n_out, kernel, padding=self.pad, dilation=dilation))
        self.conv2 = weight_norm(nn.Conv1d(n_out, n_out, kernel, padding=self.pad, dilation=dilation))
        self.dropout = nn.Dropout(dropout)
        self.downsample = nn.Conv1d(n_in, n_out, 1) if n_in != n_out else None

    def forward(self, x):
        out = self.dropout(F.relu(self.conv1(x)[..., :-self.pad]))
        out = self.dropout(F.relu(self.conv2(out)[..., :-self.pad]))
        res = x if self.downsample is None else self.downsample(x)
        return F.relu(out + res)


def build_tcn(n_in, channels, kernel, dropout):
    layers = []
    for i, ch in enumerate(channels):
        layers.append(TemporalBlock(n_in if i == 0 else channels[i - 1], ch, kernel, 2 ** i, dropout))
    return nn.Sequential(*layers)


class EnergyGate(nn.Module):
    """Re-weights time steps by their share of the feature energy."""

    def forward(self, h):
        energy = (h * h).sum(dim=1, keepdim=True)  # expect: AMP004
        attn = energy / (energy.amax(dim=-1, keepdim=True) + 1e-8)
        return h * (0.5 + attn)


class TCNAutoencoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        nf, ch = cfg["n_features"], cfg["channels"]
        self.revin = RevIN(nf)
        self.encoder = build_tcn(nf, ch, cfg["kernel"], cfg["dropout"])
        self.enc_out = nn.Conv1d(ch[-1], ch[-1], 1)
        self.gate = EnergyGate()
        self.to_latent = nn.Linear(ch[-1], cfg["latent"])
        self.from_latent = nn.Linear(cfg["latent"], ch[-1])
        self.decoder = build_tcn(ch[-1], list(reversed(ch)), cfg["kernel"], cfg["dropout"])
        self.head = nn.Conv1d(ch[0], nf, 1)

    def forward(self, x):
        xn = self.revin.normalize(x)
        h = self.enc_out(self.encoder(xn))
        pooled = h.mean(dim=-1)  # expect: AMP004
        h = self.gate(h)
        z = self.to_latent(pooled)
        zc = z - z.mean(dim=0, keepdim=True)  # expect: AMP004
        zs = z.std(dim=0) + 1e-4  # expect: AMP004
        cov = (zc.transpose(0, 1) @ zc) / (z.shape[0] - 1)
        off_diag = cov - torch.diag_embed(torch.diagonal(cov))
        reg = F.relu(1.0 - zs).float().mean() + off_diag.float().pow(2).sum() / z.shape[1]
        seed = self.from_latent(z).unsqueeze(-1) + h
        recon = self.head(self.decoder(seed))
        recon = self.revin.denormalize(recon)
        err = (recon - x).pow(2).mean(dim=1)
        return AEOutput(recon, err, z, reg)


MODELS = {
    "tcn_small": lambda cfg: TCNAutoencoder(cfg),
    "tcn_large": TCNAutoencoder,
}


class ErrorStats(nn.Module):
    """Running mean/var of per-step reconstruction error (Welford-style EMA)."""

    def __init__(self, momentum=0.01):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("var", torch.ones(()))

    @torch.no_grad()
    def update(self, err):
        m = self.momentum
        batch_mean = err.mean()
        batch_var = err.var(unbiased=False)
        delta = batch_mean - self.mean
        self.mean.add_(m * delta)
        self.var.mul_(1 - m).add_(m * batch_var + m * (1 - m) * delta * delta)

    def score(self, err):
        return (err - self.mean) / torch.sqrt(self.var + 1e-12)


def fit(arch, series, epochs=30, window=128, lr=1e-3, latent_weight=0.05):
    cfg = CONFIGS[arch]
    model = MODELS[arch](cfg)
    stats = ErrorStats()
    windows = torch.from_numpy(np.lib.stride_tricks.sliding_window_view(series, window, axis=0).copy()).float()
    loader = DataLoader(TensorDataset(windows), batch_size=256, shuffle=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4, eps=1e-8)
    scaler = torch.amp.GradScaler("cpu")  # expect: AMP010
    for epoch in range(epochs):
        model.train()
        total = 0.0
        for (x,) in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
                loss = out.err.mean() + latent_weight * out.reg
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            stats.update(out.err.detach())
            total += loss.item()
        print(f"epoch {epoch}: loss {total / len(loader):.5f} err_mean {stats.mean.item():.4f}")
    return model, stats


@torch.inference_mode()
def score_series(model, stats, series, window=128):
    model.eval()
    windows = torch.from_numpy(np.lib.stride_tricks.sliding_window_view(series, window, axis=0).copy()).float()
    scores = []
    for chunk in windows.split(1024):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(chunk)
        s = stats.score(out.err.float())
        scores.append(s[:, -1].numpy())
    scores = np.concatenate(scores)
    thresh = np.percentile(scores, 99.5)
    z = (scores - scores.mean()) / (scores.std() + 1e-12)
    return scores, scores > thresh, z


def pot_threshold(scores, q=1e-4, level=0.98):
    """Peaks-over-threshold with a method-of-moments GPD fit (numpy)."""
    t = np.quantile(scores, level)
    peaks = scores[scores > t] - t
    mean, var = peaks.mean(), peaks.var() + 1e-12
    xi = 0.5 * (1 - mean ** 2 / var)
    sigma = 0.5 * mean * (mean ** 2 / var + 1)
    n, n_t = len(scores), len(peaks)
    return t + sigma / (xi + 1e-12) * ((q * n / n_t) ** (-xi) - 1)


if __name__ == "__main__":
    data = np.load("smd_machine-1-1_train.npy").astype(np.float32)
    model, stats = fit("tcn_small", data)
    test = np.load("smd_machine-1-1_test.npy").astype(np.float32)
    s, flags, _ = score_series(model, stats, test)
    print("threshold (POT):", pot_threshold(s), "flagged:", int(flags.sum()))
