"""Multivariate time-series anomaly detection with a convolutional VAE.

Server-machine telemetry (38 channels) is min-max scaled to [0, 1] per
channel and cut into sliding windows. Stage 1 pre-trains the encoder/decoder
as a plain autoencoder, stage 2 trains the VAE with KL annealing. Anomaly
score = reconstruction NLL of a window; threshold = a percentile of the
validation scores.
"""
import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

DEFAULTS = dict(window=128, stride=8, channels=38, hidden=128, latent=16, batch_size=256,
                pretrain_epochs=5, epochs=60, lr=1e-3, beta_max=1.0, anneal_epochs=20,
                au_threshold=0.01, amp=True, percentile=99.5)


class SlidingWindows(Dataset):
    def __init__(self, series: np.ndarray, window: int, stride: int, lo=None, hi=None):
        self.lo = series.min(axis=0) if lo is None else lo
        self.hi = series.max(axis=0) if hi is None else hi
        scaled = (series - self.lo) / np.maximum(self.hi - self.lo, 1e-6)
        self.x = np.clip(scaled, 0.0, 1.0).astype(np.float32)
        self.starts = np.arange(0, len(series) - window + 1, stride)
        self.window = window

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return torch.from_numpy(self.x[s:s + self.window])


class ConvVAE(nn.Module):
    def __init__(self, channels, window, hidden, latent):
        super().__init__()
        self.window = window
        self.encoder = nn.Sequential(
            nn.Conv1d(channels, hidden, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv1d(hidden, hidden, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv1d(hidden, hidden, 5, stride=2, padding=2), nn.GELU(),
        )
        flat = hidden * (window // 8)
        self.fc_mu = nn.Linear(flat, latent)
        self.fc_logvar = nn.Linear(flat, latent)
        self.fc_dec = nn.Linear(latent, flat)
        self.decoder = nn.Sequential(
            nn.ConvTranspose1d(hidden, hidden, 4, stride=2, padding=1), nn.GELU(),
            nn.ConvTranspose1d(hidden, hidden, 4, stride=2, padding=1), nn.GELU(),
            nn.ConvTranspose1d(hidden, channels, 4, stride=2, padding=1),
        )
        self.hidden = hidden

    def encode(self, x):
        h = self.encoder(x.transpose(1, 2)).flatten(1)
        return self.fc_mu(h), self.fc_logvar(h).clamp(-10.0, 10.0)

    def reparameterize(self, mu, logvar):
        if not self.training:
            return mu
        std = torch.exp(0.5 * logvar)
        return mu + std * torch.randn_like(std)

    def decode(self, z):
        h = self.fc_dec(z).view(z.size(0), self.hidden, self.window // 8)
        return torch.sigmoid(self.decoder(h)).transpose(1, 2)

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def bernoulli_nll(x_hat, x):
    """Per-window negative log-likelihood of x under Bernoulli(x_hat)."""
    log_p = torch.log(x_hat + 1e-8)  # expect: AMP011
    log_1mp = torch.log(1.0 - x_hat + 1e-8)  # expect: AMP011
    return -(x * log_p + (1.0 - x) * log_1mp).sum(dim=(1, 2))


def kl_divergence(mu, logvar):
    return -0.5 * torch.sum(1.0 + logvar - mu * mu - logvar.exp(), dim=-1)


def beta_schedule(epoch, cfg):
    return cfg["beta_max"] * min(1.0, epoch / max(1, cfg["anneal_epochs"]))


def scaled_backward(loss, scaler, accum_steps=1):
    scaler.scale(loss / accum_steps).backward()  # expect: AMP008


def pretrain_autoencoder(model, loader, cfg, device):
    """Stage 1: deterministic AE (z = mu) to get a good decoder before the KL kicks in."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scaler = torch.amp.GradScaler("cuda", enabled=cfg["amp"])
    model.train()
    for epoch in range(cfg["pretrain_epochs"]):
        total = 0.0
        for x in loader:
            x = x.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                mu, _ = model.encode(x)
                x_hat = model.decode(mu)
                loss = F.binary_cross_entropy(x_hat, x)  # expect: AMP003
                scaled_backward(loss, scaler)
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            total += loss.item()
        print(f"[pretrain] epoch {epoch} bce {total / len(loader):.5f}")


def train_vae(model, train_loader, val_loader, cfg, device, out_dir):
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=4)
    best_val = float("inf")
    for epoch in range(cfg["epochs"]):
        model.train()
        beta = beta_schedule(epoch, cfg)
        stats = {"recon": 0.0, "kl": 0.0, "au": 0.0}
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):  # expect: AMP010
                x_hat, mu, logvar = model(x)
                recon = bernoulli_nll(x_hat, x).mean()
                kl = kl_divergence(mu, logvar).mean()
                loss = recon + beta * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            with torch.no_grad():
                # active units (Burda et al.): latent dims whose posterior mean varies across inputs
                active = (mu.detach().var(dim=0) > cfg["au_threshold"]).sum().item()  # expect: AMP004
            stats["recon"] += recon.item()
            stats["kl"] += kl.item()
            stats["au"] += active
        n = len(train_loader)
        val_scores = anomaly_scores(model, val_loader, device)
        val_loss = float(val_scores.mean())
        sched.step(val_loss)
        print(f"epoch {epoch} beta {beta:.2f} recon {stats['recon'] / n:.3f} kl {stats['kl'] / n:.3f} "
              f"AU {stats['au'] / n:.1f} val_nll {val_loss:.3f}")
        if val_loss < best_val:
            best_val = val_loss
            torch.save(model.state_dict(), os.path.join(out_dir, "vae_best.pt"))
    return best_val


@torch.inference_mode()
def anomaly_scores(model, loader, device):
    model.eval()
    out = []
    for x in loader:
        x = x.to(device)
        x_hat, _, _ = model(x)
        out.append(bernoulli_nll(x_hat.float(), x).cpu().numpy())
    return np.concatenate(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True, help=".npy [T, C] normal-operation telemetry")
    ap.add_argument("--test", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--out", default="runs/vae")
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    series = np.load(args.train)
    split = int(0.8 * len(series))
    train_ds = SlidingWindows(series[:split], cfg["window"], cfg["stride"])
    val_ds = SlidingWindows(series[split:], cfg["window"], cfg["stride"], train_ds.lo, train_ds.hi)
    test_ds = SlidingWindows(np.load(args.test), cfg["window"], 1, train_ds.lo, train_ds.hi)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], shuffle=True, drop_last=True, num_workers=4)
    val_loader = DataLoader(val_ds, batch_size=1024)
    test_loader = DataLoader(test_ds, batch_size=1024)

    model = ConvVAE(cfg["channels"], cfg["window"], cfg["hidden"], cfg["latent"]).to(device)
    pretrain_autoencoder(model, train_loader, cfg, device)
    train_vae(model, train_loader, val_loader, cfg, device, args.out)

    model.load_state_dict(torch.load(os.path.join(args.out, "vae_best.pt")))
    threshold = np.percentile(anomaly_scores(model, val_loader, device), cfg["percentile"])
    test_scores = anomaly_scores(model, test_loader, device)
    labels = np.load(args.labels)[cfg["window"] - 1:][: len(test_scores)]
    pred = test_scores > threshold
    tp = int((pred & (labels == 1)).sum())
    precision = tp / max(int(pred.sum()), 1)
    recall = tp / max(int((labels == 1).sum()), 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-12)
    print(f"threshold {threshold:.2f}  P {precision:.3f}  R {recall:.3f}  F1 {f1:.3f}")


if __name__ == "__main__":
    main()
