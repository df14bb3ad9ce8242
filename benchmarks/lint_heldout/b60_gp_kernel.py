"""Deep kernel learning for heteroscedastic regression.

A feature extractor maps inputs to a latent space.  A kernel layer compares the latent
points with learned inducing points (which live in input space and go through the same
extractor) under a Matern-3/2 kernel with a learned ARD lengthscale plus an additive
Laplace component.  A linear read-out of the kernel features gives the predictive mean
and a bounded predictive variance.  Loss: Gaussian NLL + CRPS + a log-normal prior on
the lengthscale.  Mixed precision: fp16 autocast with a GradScaler.
"""
import argparse
import copy
import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SQRT3 = math.sqrt(3.0)


class GPOutput(NamedTuple):
    pred_mean: torch.Tensor
    pred_var: torch.Tensor


class FeatureExtractor(nn.Module):
    def __init__(self, in_dim, hidden, latent):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, latent),
        )

    def forward(self, x):
        return self.net(x)


class KernelLayer(nn.Module):
    """Matern-3/2 + additive Laplace kernel between latent points h and the latent
    images z of the inducing points (computed by the owner's feature extractor)."""

    def __init__(self, latent, n_inducing, in_dim):
        super().__init__()
        self.inducing = nn.Parameter(torch.randn(n_inducing, in_dim))
        self.raw_lengthscale = nn.Parameter(torch.zeros(latent))
        self.raw_outputscale = nn.Parameter(torch.zeros(2))

    def lengthscale(self):
        return F.softplus(self.raw_lengthscale) + 1e-6

    def forward(self, h, z):
        ls = self.lengthscale()
        hs = h / ls
        zs = z / ls
        cross = hs @ zs.t()
        h2 = hs.pow(2).sum(dim=-1, keepdim=True)
        z2 = zs.pow(2).sum(dim=-1)
        d2 = (h2 - 2.0 * cross + z2).clamp_min(0.0)
        dist = torch.sqrt(d2 + 1e-12)
        matern = (1.0 + SQRT3 * dist) * torch.exp(-SQRT3 * dist)
        diff = h[:, None, :] - z[None, :, :]
        r = torch.sqrt(diff * diff + 1e-12)  # expect: AMP011
        laplace = torch.exp(-(r / ls).sum(dim=-1))
        scale = F.softplus(self.raw_outputscale)
        return scale[0] * matern + scale[1] * laplace


class DeepKernelRegressor(nn.Module):
    def __init__(self, in_dim, hidden=128, latent=16, n_inducing=64, max_var=4.0):
        super().__init__()
        self.feature = FeatureExtractor(in_dim, hidden, latent)
        self.kernel = KernelLayer(latent, n_inducing, in_dim)
        self.mean_head = nn.Linear(n_inducing, 1)
        self.var_head = nn.Linear(n_inducing, 1)
        self.max_var = max_var

    def forward(self, x):
        h = self.feature(x)
        z = self.feature(self.kernel.inducing)
        k = self.kernel(h, z)
        mean = self.mean_head(k).squeeze(-1)
        var = torch.sigmoid(self.var_head(k)).squeeze(-1) * self.max_var
        return GPOutput(mean, var)


def gaussian_nll(pred_mean, pred_var, target):
    var = pred_var + 1e-10  # expect: AMP011
    err = (target - pred_mean).pow(2)
    return 0.5 * (torch.log(var) + err / var + math.log(2.0 * math.pi)).mean()


def gaussian_crps(pred_mean, pred_var, target):
    sigma = torch.sqrt(pred_var + 1e-12)  # expect: AMP011
    z = (target - pred_mean) / sigma
    pdf = torch.exp(-0.5 * z.pow(2)) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
    return (sigma * (z * (2.0 * cdf - 1.0) + 2.0 * pdf - 1.0 / math.sqrt(math.pi))).mean()


def lengthscale_prior(ls, loc=0.0, scale=1.0):
    """Log-normal prior on the ARD lengthscale (fp32 parameters)."""
    log_ls = torch.log(ls + 1e-8)
    return (0.5 * ((log_ls - loc) / scale).pow(2) + log_ls).sum()


def standardise(x_train, x_other):
    mu = x_train.mean(dim=0)
    sd = x_train.std(dim=0) + 1e-8
    return (x_train - mu) / sd, [(x - mu) / sd for x in x_other]


@torch.no_grad()
def evaluate(model, batches, device):
    model.eval()
    total_nll, total_sq, covered, n = 0.0, 0.0, 0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        out = model(x)
        mean, var = out.pred_mean.float(), out.pred_var.float()
        total_nll += gaussian_nll(mean, var, y).item() * x.size(0)
        total_sq += (mean - y).pow(2).sum().item()
        half_width = 1.96 * torch.sqrt(var + 1e-12)
        covered += ((y - mean).abs() <= half_width).sum().item()
        n += x.size(0)
    model.train()
    return total_nll / n, math.sqrt(total_sq / n), covered / n


def calibration_report(z_scores):
    z = np.asarray(z_scores, dtype=np.float64)
    levels = np.linspace(0.1, 0.9, 9)
    qs = np.quantile(np.abs(z), levels)
    return float(np.mean(np.abs(qs - levels) / (levels + 1e-12)))


def export_half(model, path):
    """Serving copy in fp16; the trained model itself stays fp32."""
    half = copy.deepcopy(model).half().eval()
    torch.save(half.state_dict(), path)


@torch.no_grad()
def acquisition_scores(model, pool_x, device, batch_size=1024):
    """Active learning: predictive entropy plus relative spread on an unlabelled pool (bf16)."""
    scores = []
    for i in range(0, pool_x.size(0), batch_size):
        x = pool_x[i:i + batch_size].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            entropy = 0.5 * torch.log(2.0 * math.pi * math.e * (out.pred_var + 1e-10))
            spread = out.pred_var / (out.pred_mean.abs() + 1e-8)
        scores.append((entropy + spread).float().cpu())
    return torch.cat(scores)


def batches_of(x, y, batch_size, shuffle=True):
    idx = torch.randperm(x.size(0)) if shuffle else torch.arange(x.size(0))
    for i in range(0, x.size(0), batch_size):
        j = idx[i:i + batch_size]
        yield x[j], y[j]


def train(args, data):
    device = torch.device("cuda")
    x_train, y_train, x_val, y_val = data
    model = DeepKernelRegressor(x_train.size(1), args.hidden, args.latent, args.inducing).to(device)

    hyper = [model.kernel.raw_lengthscale, model.kernel.raw_outputscale]
    hyper_ids = {id(p) for p in hyper}
    rest = [p for p in model.parameters() if id(p) not in hyper_ids]
    optimizer = torch.optim.Adam(
        [{"params": rest, "weight_decay": 1e-4}, {"params": hyper, "lr": args.lr * 10}],
        lr=args.lr, eps=1e-8,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.amp.GradScaler("cuda")
    n_train = x_train.size(0)

    for epoch in range(args.epochs):
        running = 0.0
        for x, y in batches_of(x_train, y_train, args.batch_size):
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
                nll = gaussian_nll(out.pred_mean, out.pred_var, y)
                crps = gaussian_crps(out.pred_mean, out.pred_var, y)
                prior = lengthscale_prior(model.kernel.lengthscale())
            mse = F.mse_loss(out.pred_mean, y)  # expect: AMP002
            loss = nll + args.crps_weight * crps + args.mse_weight * mse + prior / n_train

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            running += loss.item() * x.size(0)
        scheduler.step()

        val_nll, val_rmse, cover = evaluate(model, batches_of(x_val, y_val, 512, False), device)
        ls = model.kernel.lengthscale().detach().cpu().numpy()
        print(f"epoch {epoch}: train {running / n_train:.4f} val nll {val_nll:.4f} "
              f"rmse {val_rmse:.4f} 95% cover {cover:.3f} ls [{ls.min():.3f}, {ls.max():.3f}]")
    return model


def make_data(n=20000, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    noise = 0.1 + 0.4 * torch.sigmoid(x[:, 0])
    y = torch.sin(2.0 * x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + noise * torch.randn(n, generator=g)
    split = int(0.9 * n)
    x_train, (x_val,) = standardise(x[:split], [x[split:]])
    return x_train, y[:split], x_val, y[split:]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--latent", type=int, default=16)
    p.add_argument("--inducing", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--crps-weight", type=float, default=0.5)
    p.add_argument("--mse-weight", type=float, default=0.1)
    p.add_argument("--export", default="")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    data = make_data()
    model = train(args, data)
    pool = torch.randn(8192, data[0].size(1))
    scores = acquisition_scores(model, pool, torch.device("cuda"))
    print("next points to label:", scores.topk(16).indices.tolist())
    if args.export:
        export_half(model, args.export)


if __name__ == "__main__":
    main()
