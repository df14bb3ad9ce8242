"""Normalizing flow for tabular density estimation (UCI POWER / GAS / HEPMASS / MINIBOONE).

RealNVP-style affine couplings with ActNorm, topped by a few planar flows, over a
standard normal base. Reports test log-likelihood in nats. Mixed precision via fp16
autocast and a GradScaler (--amp); --fp16-weights stores the flow itself in half
precision to fit wider conditioners on small cards.
"""
import argparse
import logging
import math
import os
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from flows_data import load_uci

logger = logging.getLogger(__name__)
LOG_2PI = math.log(2 * math.pi)


class ActNorm(nn.Module):
    """Per-feature affine layer initialised from the first batch (Glow)."""

    def __init__(self, dim):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(dim))
        self.log_scale = nn.Parameter(torch.zeros(dim))
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                mean = x.mean(dim=0)
                std = x.std(dim=0) + 1e-6
                self.loc.data.copy_(-mean)
                self.log_scale.data.copy_(-torch.log(std))
                self.initialized.fill_(True)
        y = (x + self.loc) * torch.exp(self.log_scale)
        log_det = self.log_scale.sum().expand(x.size(0))
        return y, log_det

    def inverse(self, y):
        return y * torch.exp(-self.log_scale) - self.loc


class MeanOnlyBatchNorm(nn.Module):
    """Mean-only batch norm (Salimans & Kingma, 2016): centres, does not rescale."""

    def __init__(self, dim, momentum=0.1):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("running_mean", torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        if self.training:
            mu = x.mean(dim=0)  # expect: AMP004
            with torch.no_grad():
                self.running_mean.lerp_(mu.float(), self.momentum)
        else:
            mu = self.running_mean
        return x - mu + self.bias


class Conditioner(nn.Module):
    def __init__(self, in_dim, hidden, out_dim, n_hidden=2):
        super().__init__()
        dims = [in_dim] + [hidden] * n_hidden
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.norms = nn.ModuleList(MeanOnlyBatchNorm(hidden) for _ in range(n_hidden))
        self.out = nn.Linear(hidden, out_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x):
        h = x
        for fc, bn in zip(self.hidden, self.norms):
            h = F.elu(bn(fc(h)))
        return self.out(h)


class AffineCoupling(nn.Module):
    def __init__(self, dim, hidden, parity, s_max=3.0):
        super().__init__()
        self.parity = parity
        self.d_a = dim // 2
        self.s_max = s_max
        self.net = Conditioner(self.d_a, hidden, 2 * (dim - self.d_a))

    def _split(self, x):
        x_a, x_b = x[:, : self.d_a], x[:, self.d_a :]
        return (x_b, x_a) if self.parity else (x_a, x_b)

    def _join(self, x_a, x_b):
        return torch.cat([x_b, x_a] if self.parity else [x_a, x_b], dim=1)

    def forward(self, x):
        x_a, x_b = self._split(x)
        s, t = self.net(x_a).chunk(2, dim=1)
        s = self.s_max * torch.tanh(s / self.s_max)
        y_b = x_b * torch.exp(s) + t
        return self._join(x_a, y_b), s.sum(dim=1)

    def inverse(self, y):
        y_a, y_b = self._split(y)
        s, t = self.net(y_a).chunk(2, dim=1)
        s = self.s_max * torch.tanh(s / self.s_max)
        return self._join(y_a, (y_b - t) * torch.exp(-s))


class PlanarFlow(nn.Module):
    """f(z) = z + u_hat * tanh(w^T z + b)  (Rezende & Mohamed, 2015)."""

    def __init__(self, dim):
        super().__init__()
        self.u = nn.Parameter(torch.randn(1, dim) * 0.01)
        self.w = nn.Parameter(torch.randn(1, dim) * 0.01)
        self.b = nn.Parameter(torch.zeros(1))

    def _u_hat(self):
        # keeps w^T u_hat >= -1 so the map stays invertible
        wu = (self.w * self.u).sum()
        m = -1 + F.softplus(wu)
        return self.u + (m - wu) * self.w / (self.w.pow(2).sum() + 1e-8)

    def forward(self, z):
        u_hat = self._u_hat()
        h = torch.tanh(torch.mm(z, self.w.t()) + self.b)
        f = z + u_hat * h
        psi = (1 - h ** 2) * self.w
        det = 1 + torch.mm(psi, u_hat.t())
        log_det = torch.log(torch.abs(det) + 1e-8).squeeze(1)  # expect: AMP011
        return f, log_det


class SequentialFlow(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        log_det = x.new_zeros(x.size(0))
        for layer in self.layers:
            x, ld = layer(x)
            log_det = log_det + ld
        return x, log_det


class DensityFlow(nn.Module):
    def __init__(self, flow, dim):
        super().__init__()
        self.flow = flow
        self.dim = dim

    def log_prob(self, x):
        z, log_det = self.flow(x)
        log_pz = -0.5 * (z ** 2).sum(dim=1) - 0.5 * self.dim * LOG_2PI
        return log_pz + log_det

    def forward(self, x):
        return self.log_prob(x)


def build_flow(cfg):
    layers = [ActNorm(cfg.dim)]
    for i in range(cfg.n_coupling):
        layers.append(AffineCoupling(cfg.dim, cfg.hidden, parity=i % 2))
        layers.append(ActNorm(cfg.dim))
    layers += [PlanarFlow(cfg.dim) for _ in range(cfg.n_planar)]
    return DensityFlow(SequentialFlow(layers), cfg.dim)


def train_epoch(flow, loader, optimizer, scaler, args):
    flow.train()
    total, n = 0.0, 0
    for (x,) in loader:
        x = x.to(args.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            loss = -flow(x).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(flow.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        total += loss.item() * x.size(0)
        n += x.size(0)
    return total / n


@torch.no_grad()
def evaluate(flow, loader, args):
    flow.eval()
    lls = []
    for (x,) in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            ll = flow(x.to(args.device))
        lls.append(ll.double().cpu())
    lls = torch.cat(lls)
    return lls.mean().item(), 2 * lls.std().item() / math.sqrt(len(lls))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="power", choices=["power", "gas", "hepmass", "miniboone"])
    p.add_argument("--n-coupling", type=int, default=10)
    p.add_argument("--n-planar", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--fp16-weights", action="store_true")
    p.add_argument("--out", default="checkpoints/flow")
    args = p.parse_args()
    args.device = "cuda"
    logging.basicConfig(level=logging.INFO)

    train_x, val_x, test_x = load_uci(args.dataset)
    mu, sd = train_x.mean(axis=0), train_x.std(axis=0) + 1e-8
    train_x, val_x, test_x = ((a - mu) / sd for a in (train_x, val_x, test_x))
    mk = lambda a, shuffle: DataLoader(TensorDataset(torch.from_numpy(a.astype(np.float32))),
                                       batch_size=args.batch_size, shuffle=shuffle, drop_last=shuffle)
    train_loader, val_loader, test_loader = mk(train_x, True), mk(val_x, False), mk(test_x, False)

    cfg = SimpleNamespace(dim=train_x.shape[1], n_coupling=args.n_coupling,
                          n_planar=args.n_planar, hidden=args.hidden)
    flow = build_flow(cfg).to(args.device)
    if args.fp16_weights:
        flow = flow.half()
    optimizer = torch.optim.Adam(flow.parameters(), lr=args.lr, weight_decay=args.wd)  # expect: AMP011
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)

    os.makedirs(args.out, exist_ok=True)
    best_val = -float("inf")
    for epoch in range(args.epochs):
        train_nll = train_epoch(flow, train_loader, optimizer, scaler, args)
        scheduler.step()
        val_ll, _ = evaluate(flow, val_loader, args)
        logger.info("epoch %3d  train nll %.4f  val ll %.4f", epoch, train_nll, val_ll)
        if val_ll > best_val:
            best_val = val_ll
            torch.save(flow.state_dict(), os.path.join(args.out, f"{args.dataset}.pt"))

    flow.load_state_dict(torch.load(os.path.join(args.out, f"{args.dataset}.pt")))
    test_ll, err = evaluate(flow, test_loader, args)
    logger.info("test log-likelihood %.3f +/- %.3f nats", test_ll, err)


if __name__ == "__main__":
    main()
