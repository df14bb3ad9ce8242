"""Continuous normalizing flow (FFJORD) for tabular density estimation.

The divergence of the ODE right-hand side is estimated with Hutchinson's trace
estimator; the flow is integrated with a fixed-step RK4 solver written here so the
whole forward pass can run under autocast.  RNODE kinetic-energy and Jacobian
regularisers are accumulated along the trajectory.
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class ConcatSquashLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.layer = nn.Linear(d_in, d_out)
        self.hyper_bias = nn.Linear(1, d_out, bias=False)
        self.hyper_gate = nn.Linear(1, d_out)

    def forward(self, t, x):
        tt = t.view(1, 1)
        return self.layer(x) * torch.sigmoid(self.hyper_gate(tt)) + self.hyper_bias(tt)


class FeatureNorm(nn.Module):
    """Parameter-free per-sample normalisation inside the ODE network."""

    def forward(self, h):
        mu = h.mean(-1, keepdim=True)  # expect: AMP004
        var = h.var(-1, keepdim=True, unbiased=False)  # expect: AMP004
        return (h - mu) / torch.sqrt(var + 1e-10)  # expect: AMP011


class ODEnet(nn.Module):
    def __init__(self, dim, hidden, norm=True):
        super().__init__()
        dims = [dim, *hidden, dim]
        self.layers = nn.ModuleList([ConcatSquashLinear(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.norms = nn.ModuleList([FeatureNorm() if norm else nn.Identity() for _ in hidden])

    def forward(self, t, y):
        dx = y
        for i, layer in enumerate(self.layers):
            dx = layer(t, dx)
            if i < len(self.layers) - 1:
                dx = torch.tanh(self.norms[i](dx))
        return dx


def divergence_approx(f, y, e):
    """Hutchinson: E[e^T (df/dy) e].  The vector-Jacobian product has y's dtype (fp32)."""
    e_dzdx = torch.autograd.grad(f, y, e, create_graph=True)[0]
    e_dzdx_e = e_dzdx * e
    return e_dzdx_e.view(y.shape[0], -1).sum(dim=1, keepdim=True), e_dzdx


class ODEfunc(nn.Module):
    def __init__(self, diffeq, rademacher=True):
        super().__init__()
        self.diffeq = diffeq
        self.rademacher = rademacher
        self._e = None
        self.nfe = 0

    def reset(self):
        self._e = None
        self.nfe = 0

    def forward(self, t, states):
        y = states[0]
        self.nfe += 1
        with torch.enable_grad():
            y = y.requires_grad_(True)
            dy = self.diffeq(t, y)
            if self._e is None:
                if self.rademacher:
                    self._e = torch.randint(0, 2, y.shape, device=y.device).to(y) * 2 - 1
                else:
                    self._e = torch.randn_like(y)
            div, e_dzdx = divergence_approx(dy, y, self._e)
        b = y.shape[0]
        kinetic = (dy * dy).view(b, -1).mean(1, keepdim=True)  # expect: AMP004
        jac_frob = e_dzdx.pow(2).view(b, -1).mean(1, keepdim=True)
        return dy, -div, kinetic, jac_frob


class CNF(nn.Module):
    def __init__(self, odefunc, T=1.0, steps=8):
        super().__init__()
        self.odefunc = odefunc
        self.T, self.steps = T, steps

    def forward(self, z, logpz, reg):
        self.odefunc.reset()
        dt = self.T / self.steps
        t = torch.zeros((), device=z.device)
        states = (z, logpz, reg[0], reg[1])
        for _ in range(self.steps):
            k1 = self.odefunc(t, states)
            k2 = self.odefunc(t + dt / 2, tuple(s + dt / 2 * k for s, k in zip(states, k1)))
            k3 = self.odefunc(t + dt / 2, tuple(s + dt / 2 * k for s, k in zip(states, k2)))
            k4 = self.odefunc(t + dt, tuple(s + dt * k for s, k in zip(states, k3)))
            states = tuple(s + dt / 6 * (a + 2 * b + 2 * c + d) for s, a, b, c, d in zip(states, k1, k2, k3, k4))
            t = t + dt
        z, logpz, kin, frob = states
        return z, logpz, (kin, frob)


class MovingBatchNorm1d(nn.Module):
    def __init__(self, dim, momentum=0.1, eps=1e-4):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x, logpx, reg):
        if self.training:
            # x is the flow state, which the RK4 update keeps in fp32
            batch_mean = x.mean(0)
            batch_var = (x - batch_mean).pow(2).mean(0)
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(batch_mean * self.momentum)
                self.running_var.mul_(1 - self.momentum).add_(batch_var * self.momentum)
        else:
            batch_mean, batch_var = self.running_mean, self.running_var
        y = (x - batch_mean) * torch.exp(-0.5 * torch.log(batch_var + self.eps))
        y = y * torch.exp(self.weight) + self.bias
        logdet = (self.weight - 0.5 * torch.log(batch_var + self.eps)).sum()
        return y, logpx - logdet.expand_as(logpx), reg


class SequentialFlow(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.chain = nn.ModuleList(layers)

    def forward(self, x, logpx, reg):
        for layer in self.chain:
            x, logpx, reg = layer(x, logpx, reg)
        return x, logpx, reg


def build_flow(dim, hidden=(64, 64, 64), num_blocks=2, steps=8):
    layers = [MovingBatchNorm1d(dim)]
    for _ in range(num_blocks):
        layers += [CNF(ODEfunc(ODEnet(dim, list(hidden))), steps=steps), MovingBatchNorm1d(dim)]
    return SequentialFlow(layers)


def standard_normal_logprob(z):
    return -0.5 * math.log(2 * math.pi) - z.pow(2) / 2


def nll_and_reg(model, x):
    b = x.shape[0]
    zeros = torch.zeros(b, 1, device=x.device)
    z, delta_logp, (kin, frob) = model(x, zeros, (zeros, zeros))
    logpz = standard_normal_logprob(z).view(b, -1).sum(1, keepdim=True)
    logpx = logpz - delta_logp
    return -logpx.mean(), kin.mean(), frob.mean()


def train(args, data):
    device = torch.device("cuda")
    loader = DataLoader(TensorDataset(torch.from_numpy(data["train"]).float()), batch_size=args.batch_size,
                        shuffle=True, drop_last=True)
    model = build_flow(data["train"].shape[1], steps=args.steps).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-6)
    scaler = torch.amp.GradScaler("cuda")
    itr = 0
    for epoch in range(args.epochs):
        model.train()
        for (x,) in loader:
            x = x.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                nll, kin, frob = nll_and_reg(model, x)
                loss = nll + args.kinetic * kin + args.jacobian * frob
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            itr += 1
            if itr % 100 == 0:
                print(f"iter {itr} nll {nll.item():.4f} kinetic {kin.item():.4f} jac {frob.item():.4f}")
        val_nll = evaluate(model, data["val"], device)
        print(f"epoch {epoch} val nll {val_nll:.4f}")
    return model


@torch.no_grad()
def evaluate(model, x_val, device, batch_size=4096):
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(x_val), batch_size):
        x = torch.from_numpy(x_val[i:i + batch_size]).float().to(device)
        nll, _, _ = nll_and_reg(model, x)
        total += nll.item() * x.shape[0]
        n += x.shape[0]
    model.train()
    return total / n


def load_tabular(path):
    arr = np.load(path)
    x = arr["data"].astype(np.float32)
    mu, sd = x.mean(0), x.std(0)
    x = (x - mu) / (sd + 1e-8)
    n_val = len(x) // 10
    return {"train": x[n_val:], "val": x[:n_val]}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/miniboone.npz")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--kinetic", type=float, default=0.01)
    p.add_argument("--jacobian", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=10.0)
    a = p.parse_args()
    train(a, load_tabular(a.data))
