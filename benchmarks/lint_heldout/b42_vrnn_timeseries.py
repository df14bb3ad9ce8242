"""Variational RNN (Chung et al., 2015) for multivariate sensor series with missing
values: a Gaussian emission for observed values and a Bernoulli emission for the
observation mask. Loss terms are balanced with learned uncertainty weights.

Mixed precision: CUDA fp16 autocast enabled by ``cfg.amp`` with a GradScaler; an
optional pure-fp16 mode for throughput experiments.
"""
import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class VRNNConfig:
    x_dim: int = 36
    h_dim: int = 256
    z_dim: int = 32
    lr: float = 1e-3
    amp: bool = True
    pure_fp16: bool = False
    accum: int = 2
    clip: float = 10.0
    kl_warmup: int = 5000
    pretrain_steps: int = 2000
    epochs: int = 50


@dataclass
class StepOut:
    h: torch.Tensor
    kl: torch.Tensor
    nll: torch.Tensor
    obs_ll: torch.Tensor
    mu_q: torch.Tensor


@dataclass
class VRNNOutput:
    nll: torch.Tensor
    kl: torch.Tensor
    obs_ll: torch.Tensor


def gaussian_kl(mu_q, logvar_q, mu_p, logvar_p):
    # exp and pow run in fp32 under CUDA autocast: the whole KL is fp32
    return 0.5 * (logvar_p - logvar_q + (torch.exp(logvar_q) + (mu_q - mu_p) ** 2) / torch.exp(logvar_p) - 1.0).sum(-1)


class VRNN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        x, h, z = cfg.x_dim, cfg.h_dim, cfg.z_dim
        self.h_dim = h
        self.phi_x = nn.Sequential(nn.Linear(2 * x, h), nn.ReLU(), nn.Linear(h, h))
        self.phi_z = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, h))
        self.prior = nn.Sequential(nn.Linear(h, h), nn.ReLU())
        self.prior_mu = nn.Linear(h, z)
        self.prior_logvar = nn.Linear(h, z)
        self.enc = nn.Sequential(nn.Linear(2 * h, h), nn.ReLU())
        self.enc_mu = nn.Linear(h, z)
        self.enc_logvar = nn.Linear(h, z)
        self.dec = nn.Sequential(nn.Linear(2 * h, h), nn.ReLU())
        self.dec_mu = nn.Linear(h, x)
        self.dec_scale = nn.Linear(h, x)
        self.dec_obs = nn.Linear(h, x)
        self.rnn = nn.GRUCell(2 * h, h)
        self.active_units = None

    def step(self, x_t, m_t, h, sample=True):
        phi_x = self.phi_x(torch.cat([x_t * m_t, m_t], dim=-1))
        pri = self.prior(h)
        mu_p = self.prior_mu(pri)
        logvar_p = self.prior_logvar(pri)
        enc = self.enc(torch.cat([phi_x, h], dim=-1))
        mu_q = self.enc_mu(enc)
        logvar_q = self.enc_logvar(enc)
        z = mu_q + torch.randn_like(mu_q) * torch.exp(0.5 * logvar_q) if sample else mu_q
        phi_z = self.phi_z(z)
        dec = self.dec(torch.cat([phi_z, h], dim=-1))
        mu_x = self.dec_mu(dec)
        std_x = 2.0 * torch.sigmoid(self.dec_scale(dec))
        obs_p = torch.sigmoid(self.dec_obs(dec))
        nll = (torch.log(std_x + 1e-8) + 0.5 * ((x_t - mu_x) / (std_x + 1e-8)) ** 2) * m_t  # expect: AMP011
        obs_ll = m_t * torch.log(obs_p + 1e-8) + (1 - m_t) * torch.log(1 - obs_p + 1e-8)  # expect: AMP011
        kl = gaussian_kl(mu_q, logvar_q, mu_p, logvar_p)
        h = self.rnn(torch.cat([phi_x, phi_z], dim=-1), h)
        return StepOut(h, kl, nll.sum(-1), obs_ll.sum(-1), mu_q)

    def forward(self, x, m, sample=True):
        B, T, _ = x.shape
        h = x.new_zeros(B, self.h_dim)
        nll = kl = obs_ll = 0.0
        for t in range(T):
            out = self.step(x[:, t], m[:, t], h, sample=sample)
            h = out.h
            nll = nll + out.nll
            kl = kl + out.kl
            obs_ll = obs_ll + out.obs_ll
        with torch.no_grad():
            # posterior-collapse diagnostic: latent dims whose posterior mean varies across the batch
            self.active_units = (out.mu_q.var(dim=0) > 0.01).float().mean()  # expect: AMP004
        return VRNNOutput(nll / T, kl / T, obs_ll / T)


class LossWeights(nn.Module):
    """Homoscedastic uncertainty weighting (Kendall et al., 2018) of the loss terms."""

    def __init__(self, n_terms=3):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(n_terms))

    def forward(self, terms):
        return (torch.exp(-self.log_vars) * terms + self.log_vars).sum()


def build(cfg, device):
    model = VRNN(cfg).to(device)
    if cfg.pure_fp16:
        model = model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)  # expect: AMP011
    loss_weights = LossWeights().to(device)
    w_opt = torch.optim.SGD(loss_weights.parameters(), lr=1e-3)
    return model, optimizer, loss_weights, w_opt


def pretrain_decoder(model, loader, optimizer, steps):
    """Warm-up with the posterior mean (no sampling) before the KL term is switched on."""
    model.train()
    for i, (x, m) in enumerate(loader):
        if i == steps:
            break
        x, m = x.cuda(non_blocking=True), m.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            out = model(x, m, sample=False)
            loss = out.nll.mean() - out.obs_ll.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_epoch(model, optimizer, loss_weights, w_opt, scaler, loader, cfg, step):
    model.train()
    for i, (x, m) in enumerate(loader):
        x, m = x.cuda(non_blocking=True), m.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            # per-series standardisation of the raw input (loader tensors, dtype not known here)
            x = (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True) + 1e-8)
            out = model(x, m)
            beta = min(1.0, step / cfg.kl_warmup)
            terms = torch.stack([out.nll.mean(), beta * out.kl.mean(), -out.obs_ll.mean()])
            loss = loss_weights(terms)
        scaler.scale(loss / cfg.accum).backward()
        if (i + 1) % cfg.accum == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            scaler.step(optimizer)
            scaler.update()
            w_opt.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
            w_opt.zero_grad(set_to_none=True)
            step += 1
            if step % 200 == 0:
                print(f"step {step} loss {loss.item():.3f} active units {model.active_units.item():.2f}")
    return step


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, n = 0.0, 0
    for x, m in loader:
        x, m = x.cuda(), m.cuda()
        x = (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True) + 1e-8)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x, m, sample=False)
        total += (out.nll + out.kl).sum().item()
        n += x.size(0)
    model.train()
    return total / max(n, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--pure-fp16", action="store_true")
    args = p.parse_args()
    cfg = VRNNConfig(amp=not args.no_amp, pure_fp16=args.pure_fp16)
    data = torch.load(args.data)
    model, optimizer, loss_weights, w_opt = build(cfg, "cuda")
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
    pretrain_decoder(model, data["train"], optimizer, cfg.pretrain_steps)
    step, best = 0, float("inf")
    for epoch in range(cfg.epochs):
        step = train_epoch(model, optimizer, loss_weights, w_opt, scaler, data["train"], cfg, step)
        val = evaluate(model, data["val"])
        print(f"epoch {epoch}: val nll+kl per series {val:.3f}, weights {F.softmax(-loss_weights.log_vars, 0).tolist()}")
        if val < best:
            best = val
            torch.save({"model": model.state_dict(), "cfg": cfg}, "vrnn_best.pt")


if __name__ == "__main__":
    main()
