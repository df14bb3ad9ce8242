"""Sparse variational deep-kernel GP (SV-DKL) for tabular regression.

An MLP feature extractor feeds a whitened SVGP layer with an ARD-RBF kernel.
The extractor runs under autocast; everything that touches a Cholesky factor is
kept in fp32.

    python dkl_uci.py --dataset protein --num_inducing 512 --epochs 200
"""
import argparse
import copy
import logging
import math
import os
from typing import NamedTuple

import numpy as np
import torch as th
import torch.nn.functional as F
from torch import nn

from uci_data import load_uci_split, standardize_targets

log = logging.getLogger("dkl")


# --------------------------------------------------------------------------- #
# kernel + variational layer
# --------------------------------------------------------------------------- #
class RBFKernel(nn.Module):
    def __init__(self, dim, ard=True):
        super().__init__()
        self.raw_lengthscale = nn.Parameter(th.zeros(dim if ard else 1))
        self.raw_outputscale = nn.Parameter(th.zeros(()))

    @property
    def lengthscale(self):
        return F.softplus(self.raw_lengthscale) + 1e-4

    @property
    def outputscale(self):
        return F.softplus(self.raw_outputscale)

    def forward(self, x1, x2):
        ls = self.lengthscale
        d2 = th.cdist(x1 / ls, x2 / ls).pow(2)
        return self.outputscale * th.exp(-0.5 * d2)


class SVGPLayer(nn.Module):
    """Whitened SVGP: u = Lz v, q(v) = N(m, S S^T)."""

    def __init__(self, num_inducing, dim, jitter=1e-6):
        super().__init__()
        self.inducing = nn.Parameter(th.randn(num_inducing, dim))
        self.q_mu = nn.Parameter(th.zeros(num_inducing))
        self.q_sqrt = nn.Parameter(th.eye(num_inducing) * 1e-2)
        self.kernel = RBFKernel(dim)
        self.jitter = jitter

    def forward(self, z):
        with th.autocast("cuda", enabled=False):
            z = z.float()
            M = self.inducing.shape[0]
            Kzz = self.kernel(self.inducing, self.inducing) + self.jitter * th.eye(M, device=z.device)
            Lz = th.linalg.cholesky(Kzz)
            A = th.linalg.solve_triangular(Lz, self.kernel(self.inducing, z), upper=False)   # M x N
            S = th.tril(self.q_sqrt)
            mean = A.T @ self.q_mu
            SA = S.T @ A
            var = self.kernel.outputscale - A.pow(2).sum(dim=0) + SA.pow(2).sum(dim=0)
            return mean, var.clamp_min(1e-8)

    def kl_divergence(self):
        with th.autocast("cuda", enabled=False):
            S = th.tril(self.q_sqrt)
            M = S.shape[0]
            logdet = 2.0 * th.log(th.diagonal(S).abs() + 1e-8).sum()
            return 0.5 * (S.pow(2).sum() + self.q_mu.pow(2).sum() - M - logdet)


# --------------------------------------------------------------------------- #
# model
# --------------------------------------------------------------------------- #
def make_extractor(in_dim, hidden_sizes, feat_dim, dropout):
    layers = []
    for h in hidden_sizes:
        layers += [nn.Linear(in_dim, h), nn.GELU(), nn.Dropout(dropout)]
        in_dim = h
    layers.append(nn.Linear(in_dim, feat_dim))
    return nn.Sequential(*layers)


class GPOutput(NamedTuple):
    mean: th.Tensor
    var: th.Tensor
    noise: th.Tensor


class DeepKernelGP(nn.Module):
    def __init__(self, in_dim, cfg):
        super().__init__()
        self.extractor = make_extractor(in_dim, cfg.hidden_sizes, cfg.feat_dim, cfg.dropout)
        self.gp = SVGPLayer(cfg.num_inducing, cfg.feat_dim)
        self.heteroscedastic = cfg.heteroscedastic
        self.noise_head = nn.Linear(cfg.feat_dim, 1)
        self.raw_noise = nn.Parameter(th.tensor(-2.0))
        self.register_buffer("running_mu", th.zeros(1, cfg.feat_dim))
        self.register_buffer("running_sigma", th.ones(1, cfg.feat_dim))
        self.stat_momentum = 0.05

    def features(self, x):
        z = self.extractor(x)
        if self.training:
            mu = z.mean(dim=0, keepdim=True)  # expect: AMP004
            sigma = z.std(dim=0, keepdim=True)  # expect: AMP004
            z_std = (z - mu) / (sigma + 1e-8)  # expect: AMP011
            with th.no_grad():
                self.running_mu.lerp_(mu.float(), self.stat_momentum)
                self.running_sigma.lerp_(sigma.float(), self.stat_momentum)
        else:
            z_std = (z - self.running_mu) / (self.running_sigma + 1e-8)
        return z_std

    def forward(self, x):
        z = self.features(x)
        mean, var = self.gp(z)
        if self.heteroscedastic:
            noise = F.softplus(self.noise_head(z)).squeeze(-1) + 1e-8
        else:
            noise = F.softplus(self.raw_noise).expand_as(mean) + 1e-8
        return GPOutput(mean=mean, var=var, noise=noise)


def negative_elbo(out: GPOutput, y, model, num_data):
    noise = out.noise.float()
    ell = -0.5 * (th.log(2 * math.pi * noise) + ((y - out.mean) ** 2 + out.var) / noise)
    return -(ell.sum() * (num_data / y.shape[0]) - model.gp.kl_divergence()) / num_data


# --------------------------------------------------------------------------- #
# training
# --------------------------------------------------------------------------- #
@th.no_grad()
def init_inducing_kmeans(model, loader, device, iters=20):
    feats = th.cat([model.extractor(x.to(device)).float() for x, _ in loader])
    M = model.gp.inducing.shape[0]
    centers = feats[th.randperm(feats.shape[0], device=feats.device)[:M]].clone()
    for _ in range(iters):
        assign = th.cdist(feats, centers).argmin(dim=1)
        for j in range(M):
            members = feats[assign == j]
            if len(members):
                centers[j] = members.mean(dim=0)
    centers = (centers - feats.mean(dim=0)) / (feats.std(dim=0) + 1e-8)
    model.gp.inducing.copy_(centers)


def pretrain_extractor(model, loader, cfg, device):
    """Warm-start the extractor with a linear read-out before the GP is switched on."""
    head = nn.Linear(cfg.feat_dim, 1).to(device)
    params = list(model.extractor.parameters()) + list(head.parameters())
    optimizer = th.optim.AdamW(params, lr=cfg.pretrain_lr, weight_decay=1e-4)
    model.train()
    for epoch in range(cfg.pretrain_epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with th.autocast("cuda", dtype=th.float16):  # expect: AMP010
                pred = head(model.extractor(x)).squeeze(-1)
                loss = F.mse_loss(pred, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        log.info("pretrain epoch %d mse %.4f", epoch, loss.item())


@th.no_grad()
def evaluate(model, loader, y_std, device):
    model.eval()
    se, nll, n = 0.0, 0.0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        pred_var = out.var + out.noise
        se += ((out.mean - y) ** 2).sum().item()
        nll += (0.5 * th.log(2 * math.pi * pred_var) + 0.5 * (y - out.mean) ** 2 / pred_var).sum().item()
        n += y.shape[0]
    return math.sqrt(se / n) * y_std, nll / n + math.log(y_std)


def fit(model, train_loader, valid_loader, cfg, y_std, device):
    gp_params = [p for n, p in model.named_parameters() if not n.startswith("extractor.")]
    optimizer = th.optim.Adam([
        {"params": model.extractor.parameters(), "lr": cfg.lr, "weight_decay": cfg.weight_decay},
        {"params": gp_params, "lr": cfg.gp_lr},
    ])
    scheduler = th.optim.lr_scheduler.MultiStepLR(optimizer, [int(0.5 * cfg.epochs), int(0.75 * cfg.epochs)], 0.1)
    scaler = th.amp.GradScaler("cuda")
    num_data = len(train_loader.dataset)
    best, best_state = float("inf"), None
    for epoch in range(cfg.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            with th.autocast("cuda", dtype=th.float16):
                out = model(x)
                loss = negative_elbo(out, y, model, num_data)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        rmse, nll = evaluate(model, valid_loader, y_std, device)
        log.info("epoch %d  loss %.4f  valid rmse %.4f  nll %.4f  scale %.0f", epoch, loss.item(), rmse, nll,
                 scaler.get_scale())
        if nll < best:
            best, best_state = nll, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="protein")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--hidden_sizes", type=int, nargs="+", default=[1000, 500, 50])
    parser.add_argument("--feat_dim", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--num_inducing", type=int, default=512)
    parser.add_argument("--heteroscedastic", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--gp_lr", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=1e-4)
    parser.add_argument("--pretrain_lr", type=float, default=1e-3)
    parser.add_argument("--pretrain_epochs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--out", default="results/dkl")
    cfg = parser.parse_args()

    logging.basicConfig(level=logging.INFO)
    os.makedirs(cfg.out, exist_ok=True)
    device = th.device("cuda")
    th.manual_seed(cfg.split)
    np.random.seed(cfg.split)

    (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = load_uci_split(cfg.dataset, cfg.split)
    y_tr, y_va, y_te, y_mean, y_std = standardize_targets(y_tr, y_va, y_te)
    make = lambda x, y, shuffle: th.utils.data.DataLoader(  # noqa: E731
        th.utils.data.TensorDataset(th.as_tensor(x, dtype=th.float32), th.as_tensor(y, dtype=th.float32)),
        batch_size=cfg.batch_size, shuffle=shuffle)
    train_loader, valid_loader, test_loader = make(x_tr, y_tr, True), make(x_va, y_va, False), make(x_te, y_te, False)

    model = DeepKernelGP(x_tr.shape[1], cfg).to(device)
    pretrain_extractor(model, train_loader, cfg, device)
    init_inducing_kmeans(model, train_loader, device)
    model = fit(model, train_loader, valid_loader, cfg, y_std, device)
    rmse, nll = evaluate(model, test_loader, y_std, device)
    log.info("TEST %s split %d: rmse %.4f nll %.4f", cfg.dataset, cfg.split, rmse, nll)
    np.save(os.path.join(cfg.out, f"{cfg.dataset}_{cfg.split}.npy"), np.array([rmse, nll]))


if __name__ == "__main__":
    main()
