"""Graph neural ODE for traffic-speed forecasting (STGODE / MTGNN-style learned adjacency).

Runs on CPU servers (AMX) with bf16 autocast; METR-LA / PEMS-BAY style windows.
"""
import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


@dataclass
class ODEConfig:
    num_nodes: int = 207
    in_steps: int = 12
    out_steps: int = 12
    in_dim: int = 2
    hidden: int = 64
    node_emb: int = 40
    top_k: int = 20
    alpha: float = 3.0
    ode_steps: int = 6
    adj_l1: float = 1e-4
    lr: float = 2e-3
    epochs: int = 100
    clip: float = 5.0


class StandardScaler:
    """Z-score normaliser for the speed channel (fitted on the training split)."""

    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def transform(self, x):
        return (x - self.mean) / self.std

    def inverse_transform(self, x):
        return x * self.std + self.mean


class AdaptiveAdjacency(nn.Module):
    """MTGNN graph learner: asymmetric, sparsified to the top-k neighbours per node."""

    def __init__(self, num_nodes, emb_dim, alpha, k):
        super().__init__()
        self.alpha, self.k = alpha, k
        self.emb1 = nn.Embedding(num_nodes, emb_dim)
        self.emb2 = nn.Embedding(num_nodes, emb_dim)
        self.lin1 = nn.Linear(emb_dim, emb_dim)
        self.lin2 = nn.Linear(emb_dim, emb_dim)
        self.register_buffer("idx", torch.arange(num_nodes))

    def forward(self):
        v1 = torch.tanh(self.alpha * self.lin1(self.emb1(self.idx)))
        v2 = torch.tanh(self.alpha * self.lin2(self.emb2(self.idx)))
        a = torch.mm(v1, v2.t()) - torch.mm(v2, v1.t())
        adj = F.relu(torch.tanh(self.alpha * a))
        _, nbr = adj.topk(self.k, dim=1)
        keep = torch.zeros_like(adj).scatter_(1, nbr, 1.0)
        return adj * keep


def sym_normalize(adj):
    adj = adj + torch.eye(adj.size(0), device=adj.device, dtype=adj.dtype)
    deg = adj.sum(dim=-1)  # expect: AMP004
    d_inv_sqrt = (deg + 1e-8).pow(-0.5)
    return d_inv_sqrt[:, None] * adj * d_inv_sqrt[None, :]


class TemporalEncoder(nn.Module):
    """Flattens the input window per node and normalises across nodes (graph norm)."""

    def __init__(self, in_steps, in_dim, hidden):
        super().__init__()
        self.proj = nn.Linear(in_steps * in_dim, hidden)

    def forward(self, x):  # x: (B, T, N, C)
        B, T, N, C = x.shape
        z = self.proj(x.permute(0, 2, 1, 3).reshape(B, N, T * C))
        mu = z.mean(dim=1, keepdim=True)  # expect: AMP004
        sd = z.std(dim=1, keepdim=True) + 1e-8  # expect: AMP004
        return (z - mu) / sd


class GraphODEFunc(nn.Module):
    """dh/dt = a/2 (A h - h) + h W - h + h0   (continuous graph diffusion, STGODE)."""

    def __init__(self, hidden, num_nodes):
        super().__init__()
        self.alpha = nn.Parameter(0.8 * torch.ones(num_nodes))
        self.w = nn.Linear(hidden, hidden, bias=False)
        self.adj = None
        self.h0 = None

    def set_state(self, adj, h0):
        self.adj, self.h0 = adj, h0

    def forward(self, t, h):
        a = torch.sigmoid(self.alpha)[None, :, None]
        ah = torch.matmul(self.adj, h)
        return a / 2 * (ah - h) + self.w(h) - h + self.h0


def rk4_solve(func, h0, t_grid):
    h, traj = h0, [h0]
    for t0, t1 in zip(t_grid[:-1], t_grid[1:]):
        dt = float(t1 - t0)
        k1 = func(t0, h)
        k2 = func(t0 + dt / 2, h + dt / 2 * k1)
        k3 = func(t0 + dt / 2, h + dt / 2 * k2)
        k4 = func(t1, h + dt * k3)
        h = h + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
        traj.append(h)
    return traj


class AttentiveReadout(nn.Module):
    """Attention over the ODE trajectory (one state per solver step)."""

    def __init__(self, hidden):
        super().__init__()
        self.score = nn.Linear(hidden, 1)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, states):  # (B, S, N, H)
        w = torch.softmax(self.score(states), dim=1)
        return (w * self.value(states)).sum(dim=1)  # expect: AMP004


class GraphODEForecaster(nn.Module):
    def __init__(self, cfg: ODEConfig):
        super().__init__()
        self.graph = AdaptiveAdjacency(cfg.num_nodes, cfg.node_emb, cfg.alpha, cfg.top_k)
        self.encoder = TemporalEncoder(cfg.in_steps, cfg.in_dim, cfg.hidden)
        self.odefunc = GraphODEFunc(cfg.hidden, cfg.num_nodes)
        self.readout = AttentiveReadout(cfg.hidden)
        self.decoder = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.out_steps))
        self.register_buffer("t_grid", torch.linspace(0.0, 1.0, cfg.ode_steps + 1))

    def forward(self, x):
        adj = self.graph()
        h0 = self.encoder(x)
        self.odefunc.set_state(sym_normalize(adj), h0)
        traj = rk4_solve(self.odefunc, h0, self.t_grid)
        h = self.readout(torch.stack(traj, dim=1))
        pred = self.decoder(h).transpose(1, 2)  # (B, out_steps, N)
        return {"pred": pred, "adj_reg": adj.float().abs().mean()}


def masked_mae_loss(pred, target, null_val=0.0):
    mask = (target != null_val).float()
    mask = mask / mask.mean()
    loss = torch.abs(pred - target) * mask
    return torch.nan_to_num(loss).mean()


def load_windows(path, cfg):
    data = np.load(path)  # x: (S, T, N, C), y: (S, T, N)
    x, y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]).float()
    scaler = StandardScaler(x[..., 0].mean(), x[..., 0].std())
    x[..., 0] = scaler.transform(x[..., 0])
    return TensorDataset(x, y), scaler


def train(cfg, train_set, val_set, data_scaler):
    model = GraphODEForecaster(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-8, weight_decay=1e-4)
    grad_scaler = torch.amp.GradScaler("cpu")  # expect: AMP010
    loader = DataLoader(train_set, batch_size=64, shuffle=True, drop_last=True)
    best = float("inf")
    for epoch in range(cfg.epochs):
        model.train()
        t0, running = time.time(), 0.0
        for x, y in loader:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                out = model(x)
                loss = masked_mae_loss(out["pred"], data_scaler.transform(y)) + cfg.adj_l1 * out["adj_reg"]
            optimizer.zero_grad(set_to_none=True)
            grad_scaler.scale(loss).backward()
            grad_scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            grad_scaler.step(optimizer)
            grad_scaler.update()
            running += loss.item()
        val_mae = evaluate(model, val_set, data_scaler)
        print(f"epoch {epoch}: train {running / len(loader):.4f} val MAE {val_mae:.3f} ({time.time() - t0:.0f}s)")
        if val_mae < best:
            best = val_mae
            torch.save(model.state_dict(), "graph_ode_best.pt")
    return model


@torch.inference_mode()
def evaluate(model, dataset, data_scaler):
    model.eval()
    maes = []
    for x, y in DataLoader(dataset, batch_size=128):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            pred = data_scaler.inverse_transform(model(x)["pred"])
        mask = y != 0
        maes.append((pred - y).abs()[mask].mean().item())
    return float(np.mean(maes))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/METR-LA/train.npz")
    p.add_argument("--val", default="data/METR-LA/val.npz")
    p.add_argument("--epochs", type=int, default=100)
    args = p.parse_args()
    cfg = ODEConfig(epochs=args.epochs)
    torch.set_num_threads(16)
    train_set, data_scaler = load_windows(args.data, cfg)
    val_set, _ = load_windows(args.val, cfg)
    train(cfg, train_set, val_set, data_scaler)


if __name__ == "__main__":
    main()
