"""Mixture Density Network for multi-modal trajectory prediction.

A temporal conv encoder over each agent's history, masked social pooling over
neighbours, and one bivariate-Gaussian MDN head per agent class (ModuleDict).
"""
import math
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MDNOutput = namedtuple("MDNOutput", ["log_pi", "mu", "sigma", "rho", "one_minus_rho2"])

CFG = {
    "hist_len": 20,
    "fut_len": 30,
    "in_dim": 6,          # x, y, vx, vy, sin(heading), cos(heading)
    "hidden": 128,
    "modes": 6,
    "agent_types": ["vehicle", "pedestrian", "cyclist"],
    "active_modes": {"pedestrian": 3, "cyclist": 4},
    "lr": 5e-4,
    "epochs": 60,
    "entropy_weight": 0.01,
}


class HistoryEncoder(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.conv1 = nn.Conv1d(in_dim, hidden, 3, padding=1)
        self.conv2 = nn.Conv1d(hidden, hidden, 3, padding=2, dilation=2)

    def forward(self, hist):
        h = F.relu(self.conv1(hist.transpose(1, 2)))
        h = F.relu(self.conv2(h))
        mu_t = h.mean(-1, keepdim=True)  # expect: AMP004
        h = (h - mu_t) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-9)  # expect: AMP004, AMP011
        return h.mean(dim=-1)


class SocialPooling(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, hidden))

    def forward(self, rel, nbr_mask):
        feat = self.mlp(rel)
        dist = rel[..., :2].norm(dim=-1)
        w = nbr_mask.float() / (dist + 1e-8)
        m = w.unsqueeze(-1).to(feat.dtype)
        return (feat * m).sum(1) / (m.sum(1) + 1e-6)


class MDNHead(nn.Module):
    def __init__(self, hidden, modes, fut_len, active_modes=None):
        super().__init__()
        self.k, self.t = modes, fut_len
        self.register_buffer("mode_mask", torch.arange(modes) < (active_modes or modes))
        self.trunk = nn.Sequential(nn.Linear(2 * hidden, 2 * hidden), nn.ReLU())
        self.pi = nn.Linear(2 * hidden, modes)
        self.mu = nn.Linear(2 * hidden, modes * fut_len * 2)
        self.sigma = nn.Linear(2 * hidden, modes * fut_len * 2)
        self.rho = nn.Linear(2 * hidden, modes * fut_len)

    def forward(self, ctx):
        b = ctx.shape[0]
        h = self.trunk(ctx)
        pi_logits = self.pi(h).masked_fill(~self.mode_mask, -1e9)  # expect: AMP007
        log_pi = F.log_softmax(pi_logits, dim=-1)
        mu = self.mu(h).view(b, self.k, self.t, 2).cumsum(dim=2)
        sigma = F.elu(self.sigma(h)).view(b, self.k, self.t, 2) + 1 + 1e-8  # expect: AMP011
        rho = torch.tanh(self.rho(h)).view(b, self.k, self.t)
        one_minus_rho2 = 1 - rho * rho + 1e-8  # expect: AMP011
        return MDNOutput(log_pi, mu, sigma, rho, one_minus_rho2)


class TrajectoryPredictor(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = HistoryEncoder(cfg["in_dim"], cfg["hidden"])
        self.social = SocialPooling(cfg["hidden"])
        self.heads = nn.ModuleDict({
            name: MDNHead(cfg["hidden"], cfg["modes"], cfg["fut_len"], cfg["active_modes"].get(name))
            for name in cfg["agent_types"]
        })

    def forward(self, hist, rel_nbrs, nbr_mask):
        ctx = torch.cat([self.encoder(hist), self.social(rel_nbrs, nbr_mask)], dim=-1)
        return {name: head(ctx) for name, head in self.heads.items()}


class BivariateMDNLoss(nn.Module):
    def __init__(self, entropy_weight=0.0):
        super().__init__()
        self.entropy_weight = entropy_weight

    def forward(self, out, fut, mask):
        dx = (fut[:, None, :, 0] - out.mu[..., 0]) / out.sigma[..., 0]
        dy = (fut[:, None, :, 1] - out.mu[..., 1]) / out.sigma[..., 1]
        z = dx ** 2 + dy ** 2 - 2 * out.rho * dx * dy
        log_norm = torch.log(2 * math.pi * out.sigma[..., 0] * out.sigma[..., 1]) + 0.5 * torch.log(out.one_minus_rho2)
        log_comp = (-z / (2 * out.one_minus_rho2) - log_norm).sum(-1)
        nll = -torch.logsumexp(out.log_pi + log_comp, dim=1)
        pi = out.log_pi.exp()
        entropy = -(pi * torch.log(pi + 1e-8)).sum(-1)
        per_agent = nll - self.entropy_weight * entropy
        return (per_agent * mask).sum() / mask.sum().clamp(min=1)


def build_model(cfg):
    model = TrajectoryPredictor(cfg)
    criterion = BivariateMDNLoss(cfg["entropy_weight"])
    return model, criterion


@torch.no_grad()
def evaluate(model, loader, agent_types):
    model.eval()
    ade, fde, n = 0.0, 0.0, 0
    for batch in loader:
        batch = {k: v.cuda() for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(batch["hist"], batch["rel_nbrs"], batch["nbr_mask"])
        for idx, name in enumerate(agent_types):
            sel = batch["agent_type"] == idx
            if not sel.any():
                continue
            mu = out[name].mu[sel].float()
            err = (mu - batch["fut"][sel][:, None]).norm(dim=-1)
            ade += err.mean(-1).min(1).values.sum().item()
            fde += err[..., -1].min(1).values.sum().item()
            n += int(sel.sum())
    model.train()
    return ade / max(n, 1), fde / max(n, 1)


def sample_trajectories(out, num_samples=20):
    """Draw samples from the mixture (numpy, for visualisation)."""
    pi = out.log_pi.float().exp().cpu().numpy()
    mu, sigma = out.mu.float().cpu().numpy(), out.sigma.float().cpu().numpy()
    samples = []
    for b in range(pi.shape[0]):
        modes = np.random.choice(pi.shape[1], size=num_samples, p=pi[b] / (pi[b].sum() + 1e-12))
        samples.append(mu[b, modes] + sigma[b, modes] * np.random.randn(num_samples, *mu.shape[2:]))
    return np.stack(samples)


def train(cfg, train_loader, val_loader):
    model, criterion = build_model(cfg)
    model = model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], eps=1e-8)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    best_ade = 1e9
    for epoch in range(cfg["epochs"]):
        model.train()
        for batch in train_loader:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                out = model(batch["hist"], batch["rel_nbrs"], batch["nbr_mask"])
                loss = sum(
                    criterion(out[name], batch["fut"], (batch["agent_type"] == i).float())
                    for i, name in enumerate(cfg["agent_types"])
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        sched.step()
        ade, fde = evaluate(model, val_loader, cfg["agent_types"])
        print(f"epoch {epoch}: loss {loss.item():.3f} minADE {ade:.3f} minFDE {fde:.3f}")
        if ade < best_ade:
            best_ade = ade
            torch.save(model.state_dict(), "mdn_traj_best.pt")
    return model
