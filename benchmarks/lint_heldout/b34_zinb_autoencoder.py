"""Deep count autoencoder (DCA-style) for single-cell RNA-seq denoising.

The decoder predicts, per cell and gene, the mean, dispersion and dropout
probability of a zero-inflated negative binomial (ZINB); training maximises the
ZINB likelihood of the raw counts.

    python b34_zinb_autoencoder.py counts.npy --epochs 300 --amp
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def preprocess(counts, min_counts=1):
    """Filter genes, compute size factors and the log-normalised, scaled input."""
    counts = counts[:, counts.sum(0) >= min_counts].astype(np.float32)
    lib = counts.sum(1)
    size_factors = lib / np.median(lib)
    log_norm = np.log1p(counts / size_factors[:, None])
    log_norm = (log_norm - log_norm.mean(0)) / (log_norm.std(0) + 1e-8)
    return counts, log_norm.astype(np.float32), size_factors.astype(np.float32)


class GaussianNoise(nn.Module):
    def __init__(self, sigma=0.1):
        super().__init__()
        self.sigma = sigma

    def forward(self, x):
        if self.training and self.sigma > 0:
            return x + self.sigma * torch.randn_like(x)
        return x


class ZINBAutoencoder(nn.Module):
    def __init__(self, n_genes, hidden=64, bottleneck=32, noise=0.1):
        super().__init__()
        self.encoder = nn.Sequential(
            GaussianNoise(noise),
            nn.Linear(n_genes, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, bottleneck), nn.BatchNorm1d(bottleneck), nn.ReLU(),
        )
        self.decoder = nn.Sequential(nn.Linear(bottleneck, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.mean_head = nn.Linear(hidden, n_genes)
        self.disp_head = nn.Linear(hidden, n_genes)
        self.drop_head = nn.Linear(hidden, n_genes)

    def forward(self, x_norm, size_factors):
        h = self.decoder(self.encoder(x_norm))
        mean = torch.clamp(torch.exp(self.mean_head(h)), 1e-5, 1e6)
        disp = torch.clamp(torch.exp(self.disp_head(h)), 1e-4, 1e4)
        pi = torch.sigmoid(self.drop_head(h))
        return mean * size_factors.unsqueeze(1), disp, pi

    @torch.no_grad()
    def bottleneck_features(self, x_norm):
        self.eval()
        return self.encoder(x_norm)


def log_zinb_positive(x, mu, theta, pi):
    """log ZINB(x | mu, theta, pi), elementwise; mixture at zero in log space."""
    log_theta_mu = torch.log(theta + mu + 1e-10)
    log_nb_zero = theta * (torch.log(theta + 1e-10) - log_theta_mu)
    log_pi = torch.log(pi + 1e-10)  # expect: AMP011
    log_1m_pi = torch.log(1.0 - pi + 1e-10)  # expect: AMP011
    zero_case = torch.logaddexp(log_pi, log_1m_pi + log_nb_zero)
    nb_case = (
        log_1m_pi
        + log_nb_zero
        + x * (torch.log(mu + 1e-10) - log_theta_mu)
        + torch.lgamma(x + theta)
        - torch.lgamma(theta)
        - torch.lgamma(x + 1.0)
    )
    return torch.where(x < 1e-8, zero_case, nb_case)


def zinb_loss(x, mean, disp, pi):
    """Mean ZINB negative log-likelihood over cells and genes."""
    return -log_zinb_positive(x, mean, disp, pi).mean()


def fit(model, counts, log_norm, size_factors, args):
    device = torch.device("cuda")
    model.to(device)
    data = TensorDataset(torch.from_numpy(counts), torch.from_numpy(log_norm), torch.from_numpy(size_factors))
    n_val = int(len(data) * args.val_frac)
    train_set, val_set = torch.utils.data.random_split(data, [len(data) - n_val, n_val])
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1024)

    optimizer = torch.optim.RMSprop(model.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009
    best, bad_epochs = math.inf, 0
    for epoch in range(args.epochs):
        model.train()
        running, drop_rate, steps = 0.0, 0.0, 0
        for x_raw, x_norm, sf in loader:
            x_raw, x_norm, sf = x_raw.to(device), x_norm.to(device), sf.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.amp, dtype=torch.float16):  # expect: AMP009
                mean, disp, pi = model(x_norm, sf)
                loss = zinb_loss(x_raw, mean, disp, pi)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()

            running += loss.item()
            drop_rate += pi.detach().mean().item()  # expect: AMP004
            steps += 1

        val = validate(model, val_loader, device)
        print(f"epoch {epoch:3d} | train nll {running / steps:.4f} | val nll {val:.4f} "
              f"| mean dropout p {drop_rate / steps:.3f}")
        if val < best - 1e-4:
            best, bad_epochs = val, 0
            torch.save(model.state_dict(), args.out)
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                print("early stopping")
                break


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    total, n = 0.0, 0
    for x_raw, x_norm, sf in loader:
        x_raw, x_norm, sf = x_raw.to(device), x_norm.to(device), sf.to(device)
        mean, disp, pi = model(x_norm, sf)
        total += zinb_loss(x_raw, mean, disp, pi).item() * x_raw.size(0)
        n += x_raw.size(0)
    return total / n


@torch.no_grad()
def denoise(model, log_norm, size_factors, device):
    """Denoised expression = predicted NB mean (the dropout part is discarded)."""
    model.eval()
    x_norm = torch.from_numpy(log_norm).to(device)
    sf = torch.from_numpy(size_factors).to(device)
    mean, _, _ = model(x_norm, sf)
    return mean.cpu().numpy()


def main():
    parser = argparse.ArgumentParser(description="ZINB autoencoder for count denoising")
    parser.add_argument("counts", help=".npy matrix, cells x genes, raw UMI counts")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--bottleneck", type=int, default=32)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--val-frac", type=float, default=0.1)
    parser.add_argument("--patience", type=int, default=15)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--out", default="dca.pt")
    args = parser.parse_args()

    counts, log_norm, size_factors = preprocess(np.load(args.counts))
    model = ZINBAutoencoder(counts.shape[1], args.hidden, args.bottleneck, args.noise)
    fit(model, counts, log_norm, size_factors, args)
    model.load_state_dict(torch.load(args.out))
    denoised = denoise(model, log_norm, size_factors, torch.device("cuda"))
    np.save(args.counts.replace(".npy", "_denoised.npy"), denoised)


if __name__ == "__main__":
    main()
