"""Density models for the tabular / MNIST benchmarks.

* ``RealNVP``: ActNorm -> LU-decomposed invertible linear -> affine coupling,
  repeated ``num_blocks`` times; coupling networks use Glow-style ActNorm on
  their hidden features.
* ``VAE``: the MLP VAE from pytorch/examples with a Bernoulli decoder.
"""
import argparse
import logging
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from densities.datasets import load_tabular, mnist_loaders

LOG_2PI = math.log(2 * math.pi)
logger = logging.getLogger(__name__)


class ActNorm1d(nn.Module):
    """Per-feature affine layer with data-dependent initialisation (Glow)."""

    def __init__(self, num_features, scale=1.0):
        super().__init__()
        self.scale = scale
        self.loc = nn.Parameter(torch.zeros(1, num_features))
        self.log_scale = nn.Parameter(torch.zeros(1, num_features))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    @torch.no_grad()
    def initialize(self, x):
        mean = x.mean(dim=0, keepdim=True)  # expect: AMP004
        std = x.std(dim=0, keepdim=True)  # expect: AMP004
        self.loc.data.copy_(-mean)
        self.log_scale.data.copy_(torch.log(self.scale / (std + 1e-6)))
        self.initialized.fill_(1)

    def forward(self, x):
        if self.training and self.initialized.item() == 0:
            self.initialize(x)
        return (x + self.loc) * torch.exp(self.log_scale)


def zero_linear(in_features, out_features):
    layer = nn.Linear(in_features, out_features)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def coupling_net(in_features, hidden, out_features, depth=2):
    layers = [nn.Linear(in_features, hidden), ActNorm1d(hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), ActNorm1d(hidden), nn.ReLU()]
    layers.append(zero_linear(hidden, out_features))
    return nn.Sequential(*layers)


class ActNormFlow(nn.Module):
    """ActNorm as a flow step: returns the output and log|det J|."""

    def __init__(self, dim):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(dim))
        self.logs = nn.Parameter(torch.zeros(dim))
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def _init_from(self, x):
        x32 = x.float()
        self.bias.data.copy_(-x32.mean(dim=0))
        self.logs.data.copy_(-torch.log(x32.std(dim=0) + 1e-6))
        self.initialized.fill_(True)

    def forward(self, x):
        if not self.initialized:
            self._init_from(x)
        y = (x + self.bias) * torch.exp(self.logs)
        return y, self.logs.sum().expand(x.size(0))

    def inverse(self, y):
        return y * torch.exp(-self.logs) - self.bias


class InvertibleLinear(nn.Module):
    """LU-parameterised invertible linear map (Kingma & Dhariwal, 2018)."""

    def __init__(self, dim):
        super().__init__()
        w = torch.linalg.qr(torch.randn(dim, dim))[0]
        p, l, u = torch.linalg.lu(w)
        s = torch.diagonal(u)
        self.register_buffer("p", p)
        self.register_buffer("sign_s", torch.sign(s))
        self.register_buffer("l_mask", torch.tril(torch.ones(dim, dim), -1))
        self.register_buffer("eye", torch.eye(dim))
        self.l = nn.Parameter(l)
        self.u = nn.Parameter(torch.triu(u, 1))
        self.log_s = nn.Parameter(torch.log(torch.abs(s)))

    def weight(self):
        lower = self.l * self.l_mask + self.eye
        upper = self.u * self.l_mask.t() + torch.diag(self.sign_s * torch.exp(self.log_s))
        return self.p @ lower @ upper

    def forward(self, x):
        return F.linear(x, self.weight()), self.log_s.sum().expand(x.size(0))

    def inverse(self, y):
        return F.linear(y, torch.linalg.inv(self.weight()))


class AffineCoupling(nn.Module):
    def __init__(self, dim, hidden, parity):
        super().__init__()
        mask = (torch.arange(dim) % 2 == parity).float()
        self.register_buffer("mask", mask)
        self.net = coupling_net(dim, hidden, 2 * dim)

    def forward(self, x):
        x_id = x * self.mask
        h = self.net(x_id)
        shift, raw_scale = h.chunk(2, dim=-1)
        scale = torch.sigmoid(raw_scale + 2.0)
        y = x_id + (1 - self.mask) * (x + shift) * scale
        log_det = (torch.log(scale + 1e-10) * (1 - self.mask)).sum(dim=-1)  # expect: AMP011
        return y, log_det

    def inverse(self, y):
        y_id = y * self.mask
        shift, raw_scale = self.net(y_id).chunk(2, dim=-1)
        scale = torch.sigmoid(raw_scale + 2.0)
        return y_id + (1 - self.mask) * (y / scale - shift)


class SequentialFlow(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        log_det = torch.zeros(x.size(0), device=x.device)
        for layer in self.layers:
            x, ld = layer(x)
            log_det = log_det + ld.float()
        return x, log_det

    @torch.no_grad()
    def inverse(self, z):
        for layer in reversed(self.layers):
            z = layer.inverse(z)
        return z


class RealNVP(nn.Module):
    def __init__(self, dim, hidden=256, num_blocks=6):
        super().__init__()
        self.dim = dim
        layers = []
        for i in range(num_blocks):
            layers += [ActNormFlow(dim), InvertibleLinear(dim), AffineCoupling(dim, hidden, parity=i % 2)]
        self.flow = SequentialFlow(layers)

    def log_prob(self, x):
        z, log_det = self.flow(x)
        log_pz = -0.5 * z.float().pow(2).sum(dim=-1) - 0.5 * self.dim * LOG_2PI
        return log_pz + log_det

    @torch.no_grad()
    def sample(self, n, device):
        z = torch.randn(n, self.dim, device=device)
        return self.flow.inverse(z)


class VAE(nn.Module):
    def __init__(self, x_dim=784, h_dim=400, z_dim=20):
        super().__init__()
        self.x_dim = x_dim
        self.encoder = nn.Sequential(nn.Linear(x_dim, h_dim), nn.ReLU())
        self.fc_mu = nn.Linear(h_dim, z_dim)
        self.fc_std = nn.Linear(h_dim, z_dim)
        self.decoder = nn.Sequential(nn.Linear(z_dim, h_dim), nn.ReLU(), nn.Linear(h_dim, x_dim), nn.Sigmoid())

    def encode(self, x):
        h = self.encoder(x)
        return self.fc_mu(h), F.softplus(self.fc_std(h)) + 1e-8

    def reparameterize(self, mu, std):
        return mu + torch.randn_like(std) * std

    def forward(self, x):
        mu, std = self.encode(x.view(-1, self.x_dim))
        z = self.reparameterize(mu, std)
        return self.decoder(z), mu, std


def loss_function(recon_x, x, mu, std):
    bce = F.binary_cross_entropy(recon_x, x.view(-1, recon_x.size(-1)), reduction="sum")  # expect: AMP003
    mu, std = mu.float(), std.float()
    kld = -0.5 * torch.sum(1 + 2 * torch.log(std) - mu.pow(2) - std.pow(2))
    return bce + kld


def train_flow(model, loader, optimizer, epoch, args):
    model.train()
    for i, x in enumerate(loader):
        x = x.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):  # expect: AMP010
            nll = -model.log_prob(x).mean()
        optimizer.zero_grad(set_to_none=True)
        nll.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if i % args.log_interval == 0:
            bpd = nll.item() / (model.dim * math.log(2))
            logger.info("flow epoch %d [%d/%d] nll %.3f bpd %.3f", epoch, i, len(loader), nll.item(), bpd)


@torch.no_grad()
def evaluate_flow(model, loader):
    model.eval()
    total, n = 0.0, 0
    for x in loader:
        x = x.cuda()
        total += -model.log_prob(x).sum().item()
        n += x.size(0)
    return total / n


def train_vae(model, loader, optimizer, scaler, epoch, args):
    model.train()
    train_loss = 0.0
    for batch_idx, (data, _) in enumerate(loader):
        data = data.cuda(non_blocking=True)
        optimizer.zero_grad()
        with torch.cuda.amp.autocast(enabled=args.amp):  # expect: AMP009
            recon_batch, mu, std = model(data)
            loss = loss_function(recon_batch, data, mu, std)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        train_loss += loss.item()
        if batch_idx % args.log_interval == 0:
            logger.info("vae epoch %d [%d/%d] loss %.4f", epoch, batch_idx, len(loader), loss.item() / len(data))
    return train_loss / len(loader.dataset)


def test_vae(model, loader):
    model.eval()
    test_loss = 0.0
    with torch.no_grad():
        for data, _ in loader:
            data = data.cuda()
            recon, mu, std = model(data)
            test_loss += loss_function(recon, data, mu, std).item()
    return test_loss / len(loader.dataset)


@torch.no_grad()
def estimate_log_likelihood(model, data, num_samples=500):
    """Importance-weighted estimate of log p(x) for one batch (fp32)."""
    x = data.view(-1, model.x_dim)
    mu, std = model.encode(x)
    z = mu[None] + std[None] * torch.randn(num_samples, *mu.shape, device=mu.device)
    probs = model.decoder(z)
    log_px_z = (x * torch.log(probs + 1e-8) + (1 - x) * torch.log1p(-probs + 1e-7)).sum(-1)
    log_pz = (-0.5 * z.pow(2) - 0.5 * LOG_2PI).sum(-1)
    log_qz = (-0.5 * ((z - mu) / std).pow(2) - torch.log(std) - 0.5 * LOG_2PI).sum(-1)
    return (torch.logsumexp(log_px_z + log_pz - log_qz, dim=0) - math.log(num_samples)).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["flow", "vae"], default="flow")
    parser.add_argument("--dataset", default="power")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--log-interval", type=int, default=100)
    parser.add_argument("--save-dir", default="checkpoints/densities")
    args = parser.parse_args()
    os.makedirs(args.save_dir, exist_ok=True)

    if args.model == "flow":
        train_loader, val_loader, dim = load_tabular(args.dataset, args.batch_size)
        model = RealNVP(dim).cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        best = np.inf
        for epoch in range(args.epochs):
            train_flow(model, train_loader, optimizer, epoch, args)
            val_nll = evaluate_flow(model, val_loader)
            if val_nll < best:
                best = val_nll
                torch.save(model.state_dict(), os.path.join(args.save_dir, f"realnvp_{args.dataset}.pt"))
            logger.info("epoch %d val nll %.4f (best %.4f)", epoch, val_nll, best)
    else:
        train_loader, test_loader = mnist_loaders(args.batch_size)
        model = VAE().cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        try:
            scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        except (AttributeError, TypeError):
            scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
        for epoch in range(1, args.epochs + 1):
            train_loss = train_vae(model, train_loader, optimizer, scaler, epoch, args)
            test_loss = test_vae(model, test_loader)
            logger.info("epoch %d train %.4f test %.4f", epoch, train_loss, test_loss)
        data, _ = next(iter(test_loader))
        logger.info("IWAE log-likelihood %.3f", estimate_log_likelihood(model, data.cuda()).item())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
