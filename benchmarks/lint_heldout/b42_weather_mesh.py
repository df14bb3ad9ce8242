"""Encode-process-decode mesh graph network for medium-range weather forecasting.

Grid nodes (lat/lon points) are encoded onto an icosahedral mesh, processed by
message passing on the mesh, and decoded back to the grid as a probabilistic
6-hour increment (mean and scale per variable). Trained with bf16 autocast on CUDA.
"""
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Forecast(NamedTuple):
    delta: torch.Tensor   # predicted normalised increment
    sigma: torch.Tensor   # predicted scale of the increment


def mlp(d_in, d_hidden, d_out):
    # GraphCast-style MLP: every encoder/processor MLP ends in a LayerNorm
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.SiLU(), nn.Linear(d_hidden, d_out), nn.LayerNorm(d_out))


def scatter_sum(values, index, n_nodes):
    out = values.new_zeros(values.size(0), n_nodes, values.size(-1))
    return out.index_add_(1, index, values)


class MeshLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.edge_mlp = mlp(3 * d, d, d)
        self.node_mlp = mlp(2 * d, d, d)

    def forward(self, h_v, h_e, src, dst):
        e_in = torch.cat([h_e, h_v[:, src], h_v[:, dst]], dim=-1)
        h_e = h_e + self.edge_mlp(e_in)
        agg = scatter_sum(h_e, dst, h_v.size(1))
        h_v = h_v + self.node_mlp(torch.cat([h_v, agg], dim=-1))
        return h_v, h_e


class MeshForecaster(nn.Module):
    def __init__(self, n_vars, n_static, d, n_layers, graph):
        super().__init__()
        for name in ("g2m_src", "g2m_dst", "mesh_src", "mesh_dst", "m2g_src", "mesh_edge_feats"):
            self.register_buffer(name, graph[name], persistent=False)
        self.n_mesh = graph["n_mesh"]
        self.grid_enc = mlp(n_vars + n_static, d, d)
        self.mesh_embed = nn.Parameter(torch.randn(self.n_mesh, d) * 0.02)
        self.g2m = mlp(2 * d, d, d)
        self.edge_enc = mlp(self.mesh_edge_feats.size(-1), d, d)
        self.layers = nn.ModuleList([MeshLayer(d) for _ in range(n_layers)])
        self.global_proj = nn.Linear(d, d)
        self.m2g = mlp(2 * d, d, d)
        self.head = nn.Sequential(nn.Linear(d, d), nn.SiLU())
        self.mu_out = nn.Linear(d, n_vars)
        self.sigma_out = nn.Linear(d, n_vars)

    def forward(self, x, static):
        B = x.size(0)
        h_g = self.grid_enc(torch.cat([x, static.expand(B, -1, -1)], dim=-1))
        agg = scatter_sum(h_g[:, self.g2m_src], self.g2m_dst, self.n_mesh)
        mesh0 = self.mesh_embed.expand(B, -1, -1)
        h_m = mesh0 + self.g2m(torch.cat([mesh0, agg], dim=-1))
        h_e = self.edge_enc(self.mesh_edge_feats).expand(B, -1, -1)
        for layer in self.layers:
            h_m, h_e = layer(h_m, h_e, self.mesh_src, self.mesh_dst)
        # planet-wide context added to every mesh node
        ctx = self.global_proj(h_m).mean(dim=1, keepdim=True)  # expect: AMP004
        h_m = h_m + ctx
        h_g = h_g + self.m2g(torch.cat([h_g, h_m[:, self.m2g_src]], dim=-1))
        # the mesh stream is fp32 (fp32 parameter + LayerNorm outputs; + bf16 ctx promotes to fp32)
        self.last_stream_absmean = h_m.detach().abs().mean()
        hidden = self.head(h_g)
        return Forecast(self.mu_out(hidden), 2.0 * torch.sigmoid(self.sigma_out(hidden)))


def lat_weights(lats_deg):
    w = torch.cos(torch.deg2rad(lats_deg))
    return w / w.mean()


def gaussian_nll(z, out):
    # bf16 scale: an eps of 1e-8 is representable in bf16's range, nothing to report
    return torch.log(out.sigma + 1e-8) + 0.5 * ((z - out.delta) / (out.sigma + 1e-8)) ** 2


def build_forecaster(cfg, graph):
    return MeshForecaster(cfg["n_vars"], cfg["n_static"], cfg["d"], cfg["n_layers"], graph)


class ForecastTrainer:
    def __init__(self, cfg, graph, stats, device="cuda"):
        self.cfg = cfg
        self.model = build_forecaster(cfg, graph).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        self.diff_std = stats["diff_std"].to(device)        # (n_vars,) fp32
        self.lat_w = lat_weights(stats["grid_lat"]).to(device)[None, :, None]
        self.target_spread = stats["target_spread"].to(device)
        self.resid_var = torch.zeros(cfg["n_vars"], device=device)

    def weighted_loss(self, out, x_t, x_next):
        z = (x_next - x_t) / self.diff_std
        nll = gaussian_nll(z, out)
        return (nll * self.lat_w).mean()

    def train_step(self, x_t, x_next, static):
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = self.model(x_t, static)
            loss = self.weighted_loss(out, x_t, x_next)
            spread = out.delta.std(dim=1)  # expect: AMP004
            loss = loss + self.cfg["spread_weight"] * (spread - self.target_spread).abs().mean()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 32.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        with torch.no_grad():
            # running per-variable variance of the predicted increment, for curriculum logging
            self.resid_var.mul_(0.99).add_(0.01 * out.delta.detach().var(dim=(0, 1)))  # expect: AMP004
        return loss.detach(), grad_norm

    def finetune_rollout(self, x0, targets, static):
        """Autoregressive fine-tuning: backprop through n_steps model applications."""
        n_steps = targets.size(1)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            state, loss = x0, 0.0
            for k in range(n_steps):
                out = self.model(state, static)
                nxt = state + out.delta * self.diff_std
                loss = loss + self.weighted_loss(out, state, targets[:, k]) / n_steps
                state = nxt
            self.scaler.scale(loss).backward()  # expect: AMP008
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 32.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss.detach()

    @torch.no_grad()
    def validate(self, loader, static, clim):
        self.model.eval()
        rmse, acc, n = 0.0, 0.0, 0
        for x_t, x_next in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = self.model(x_t, static)
            pred = x_t + out.delta * self.diff_std
            err = ((pred - x_next) ** 2 * self.lat_w).mean(dim=1).sqrt()
            anom_p, anom_t = pred - clim, x_next - clim
            acc_b = (anom_p * anom_t * self.lat_w).sum(1) / torch.sqrt(
                (anom_p ** 2 * self.lat_w).sum(1) * (anom_t ** 2 * self.lat_w).sum(1) + 1e-12)
            rmse += err.mean(0)
            acc += acc_b.mean(0)
            n += 1
        self.model.train()
        return rmse / max(n, 1), acc / max(n, 1)


def cosine_lr(step, total, base, warmup=1000):
    if step < warmup:
        return base * step / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main(cfg, graph, stats, train_loader, rollout_loader, val_loader, static, clim):
    trainer = ForecastTrainer(cfg, graph, stats)
    total = cfg["steps"]
    it = iter(train_loader)
    for step in range(total):
        for g in trainer.opt.param_groups:
            g["lr"] = cosine_lr(step, total, cfg["lr"])
        try:
            x_t, x_next = next(it)
        except StopIteration:
            it = iter(train_loader)
            x_t, x_next = next(it)
        loss, gnorm = trainer.train_step(x_t.cuda(), x_next.cuda(), static)
        if step % 500 == 0:
            rmse, acc = trainer.validate(val_loader, static, clim)
            print(f"step {step} loss {loss.item():.4f} |g| {gnorm:.2f} rmse {rmse.mean():.4f} acc {acc.mean():.4f}")
    for x0, targets in rollout_loader:
        trainer.finetune_rollout(x0.cuda(), targets.cuda(), static)
    torch.save(trainer.model.state_dict(), cfg["out"])
