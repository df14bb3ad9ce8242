"""Mixture density network for one-to-many regression.

Bishop's inverse problem: x = 7 sin(0.75 y) + 0.5 y + noise is easy to fit as
y -> x but multi-valued as x -> y, so a plain regressor predicts the mean of the
branches. The MDN predicts a Gaussian mixture p(y | x) instead.

    python b34_mdn_regression.py --epochs 200 --amp
"""
import argparse
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

LOG_2PI = math.log(2.0 * math.pi)


def make_inverse_sine(n, noise=1.0, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.uniform(-10.5, 10.5, size=(n, 1)).astype(np.float32)
    x = 7.0 * np.sin(0.75 * y) + 0.5 * y + noise * rng.normal(size=(n, 1))
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y)


class TFLayerNorm(nn.Module):
    """LayerNorm in the TF style (epsilon inside the square root)."""

    def __init__(self, hidden_size, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class MDNHead(nn.Module):
    """Maps features to mixture logits, means and standard deviations."""

    def __init__(self, in_dim, out_dim, n_components):
        super().__init__()
        self.k, self.d = n_components, out_dim
        self.pi_head = nn.Linear(in_dim, n_components)
        self.mu_head = nn.Linear(in_dim, n_components * out_dim)
        self.sigma_head = nn.Linear(in_dim, n_components * out_dim)

    def forward(self, h):
        logit_pi = self.pi_head(h)
        mu = self.mu_head(h).view(-1, self.k, self.d)
        # ELU + 1 keeps sigma positive; the offset keeps it away from exactly 0
        sigma = F.elu(self.sigma_head(h)) + 1.0 + 1e-15  # expect: AMP011
        return logit_pi, mu, sigma.view(-1, self.k, self.d)


class MixtureDensityNetwork(nn.Module):
    def __init__(self, in_dim, out_dim, hidden=128, n_components=8):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(in_dim, hidden),
            TFLayerNorm(hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            TFLayerNorm(hidden),
            nn.Tanh(),
        )
        self.head = MDNHead(hidden, out_dim, n_components)

    def forward(self, x):
        return self.head(self.backbone(x))


def build_model(args):
    return MixtureDensityNetwork(1, 1, hidden=args.hidden, n_components=args.components)


def mdn_nll(logit_pi, mu, sigma, y):
    """Negative log-likelihood of y under the predicted Gaussian mixture."""
    y = y.unsqueeze(1).expand_as(mu)
    z = (y - mu) / sigma
    log_comp = -0.5 * z.pow(2) - torch.log(sigma + 1e-10) - 0.5 * LOG_2PI  # expect: AMP011
    log_comp = log_comp.sum(dim=-1)
    log_pi = F.log_softmax(logit_pi, dim=-1)
    return -torch.logsumexp(log_pi + log_comp, dim=-1).mean()


def mixture_entropy(logit_pi):
    """Entropy of the mixing weights; a small bonus keeps components alive."""
    probs = F.softmax(logit_pi, dim=-1)
    return -(probs * torch.log(probs + 1e-12)).sum(-1).mean()


@torch.no_grad()
def evaluate(model, x, y, device):
    model.eval()
    logit_pi, mu, sigma = model(x.to(device))
    nll = mdn_nll(logit_pi, mu, sigma, y.to(device))
    return nll.item()


@torch.no_grad()
def sample(model, x, device, n_samples=1):
    """Draw y ~ p(y | x): pick a component, then sample from its Gaussian."""
    model.eval()
    logit_pi, mu, sigma = model(x.to(device))
    comp = torch.distributions.Categorical(logits=logit_pi).sample((n_samples,))
    idx = comp.unsqueeze(-1).unsqueeze(-1).expand(-1, -1, 1, mu.size(-1))
    mu_k = mu.unsqueeze(0).expand(n_samples, -1, -1, -1).gather(2, idx).squeeze(2)
    sd_k = sigma.unsqueeze(0).expand(n_samples, -1, -1, -1).gather(2, idx).squeeze(2)
    return (mu_k + sd_k * torch.randn_like(sd_k)).cpu().numpy()


def train(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, y = make_inverse_sine(args.n_train, seed=args.seed)
    x_val, y_val = make_inverse_sine(args.n_val, seed=args.seed + 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)

    model = build_model(args).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        total, sigma_avg, n = 0.0, 0.0, 0
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logit_pi, mu, sigma = model(xb)
                loss = mdn_nll(logit_pi, mu, sigma, yb)
                loss = loss - args.entropy_weight * mixture_entropy(logit_pi)
            scaler.scale(loss).backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()

            total += loss.item() * xb.size(0)
            sigma_avg += sigma.detach().mean().item() * xb.size(0)  # expect: AMP004
            n += xb.size(0)
        scheduler.step()

        val_nll = evaluate(model, x_val, y_val, device)
        if val_nll < best:
            best = val_nll
            torch.save(model.state_dict(), args.out)
        if epoch % args.log_every == 0:
            print(
                f"epoch {epoch:4d} | train {total / n:.4f} | val nll {val_nll:.4f} "
                f"| mean sigma {sigma_avg / n:.3f} | {time.time() - t0:.1f}s"
            )
    return model


def main():
    parser = argparse.ArgumentParser(description="Mixture density network on the inverse sine problem")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-val", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--components", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--entropy-weight", type=float, default=1e-3)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", default="mdn.pt")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    model = train(args)
    x_test = torch.linspace(-2.0, 2.0, 200).unsqueeze(1)
    samples = sample(model, x_test, next(model.parameters()).device, n_samples=10)
    np.save("mdn_samples.npy", samples)


if __name__ == "__main__":
    main()
