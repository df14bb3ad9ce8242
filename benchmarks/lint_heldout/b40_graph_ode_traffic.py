"""Graph neural ODE for traffic speed forecasting on a road-sensor graph (METR-LA style).

History -> node-wise GRU encoder -> one graph ODE segment per forecast step (GCN vector
field, fixed-step solver chosen by name, kinetic-energy regulariser) -> horizon decoder.
Trained on CPU under bfloat16 autocast (no loss scaling needed for bf16).
"""
import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


@dataclass
class ODEConfig:
    num_nodes: int = 207
    in_dim: int = 2
    hidden: int = 64
    history: int = 12
    horizon: int = 12
    ode_steps: int = 4
    solver: str = "rk4"
    lr: float = 1e-3
    epochs: int = 50
    bf16: bool = True
    kinetic_weight: float = 0.01


def normalized_adjacency(adj):
    adj = adj + torch.eye(adj.size(0))
    deg = adj.sum(-1)
    inv_sqrt = deg.clamp(min=1e-12).pow(-0.5)
    return inv_sqrt[:, None] * adj * inv_sqrt[None, :]


def random_sensor_graph(n, k=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    coords = torch.rand(n, 2, generator=g)
    knn = torch.cdist(coords, coords).topk(k + 1, largest=False).indices
    adj = torch.zeros(n, n).scatter_(1, knn, 1.0)
    return torch.maximum(adj, adj.t())


def attention_pool(scores, values):
    """Softmax over the nodes, weighted sum of node states (encoder and decoder)."""
    w = torch.softmax(scores, dim=1)
    return (w * values).sum(dim=1)  # expect: AMP004


class GraphConv(nn.Module):
    """A X W with the symmetric-normalised adjacency (Kipf & Welling)."""

    def __init__(self, in_dim, out_dim, adj):
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim)
        self.register_buffer("adj", normalized_adjacency(adj))

    def forward(self, x):  # x: (B, N, C)
        return self.lin(torch.matmul(self.adj, x))


class GraphNorm(nn.Module):
    """Normalise each channel over the nodes of one graph."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)  # expect: AMP004
        centered = x - mean
        var = centered.pow(2).mean(dim=1, keepdim=True)  # expect: AMP004
        return self.weight * centered / torch.sqrt(var + self.eps) + self.bias


class ODEFunc(nn.Module):
    """dh/dt = GCN(tanh(GraphNorm(GCN(h))))."""

    def __init__(self, dim, adj):
        super().__init__()
        self.gc1 = GraphConv(dim, dim, adj)
        self.norm1 = GraphNorm(dim)
        self.gc2 = GraphConv(dim, dim, adj)
        self.nfe = 0

    def forward(self, t, h):
        self.nfe += 1
        z = torch.tanh(self.norm1(self.gc1(h)))
        return self.gc2(z)


def euler_step(func, t, h, dt):
    return h + dt * func(t, h)


def midpoint_step(func, t, h, dt):
    mid = h + 0.5 * dt * func(t, h)
    return h + dt * func(t + 0.5 * dt, mid)


def rk4_step(func, t, h, dt):
    k1 = func(t, h)
    k2 = func(t + dt / 2, h + dt / 2 * k1)
    k3 = func(t + dt / 2, h + dt / 2 * k2)
    k4 = func(t + dt, h + dt * k3)
    return h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


SOLVERS = {"euler": euler_step, "midpoint": midpoint_step, "rk4": rk4_step}


class ODEBlock(nn.Module):
    def __init__(self, dim, adj, steps, solver="rk4"):
        super().__init__()
        self.func = ODEFunc(dim, adj)
        self.steps = steps
        self.step_fn = SOLVERS[solver]

    def forward(self, h, t0=0.0, t1=1.0):
        dt = (t1 - t0) / self.steps
        t, kinetic = t0, 0.0
        for _ in range(self.steps):
            if self.training:
                dh = self.func(t, h)
                kinetic = kinetic + dh.pow(2).mean()  # expect: AMP004
            h = self.step_fn(self.func, t, h, dt)
            t += dt
        return h, kinetic / self.steps


class TrafficEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.inp = nn.Linear(cfg.in_dim, cfg.hidden)
        self.gru = nn.GRU(cfg.hidden, cfg.hidden, batch_first=True)
        self.score = nn.Linear(cfg.hidden, 1)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):  # x: (B, T, N, C)
        b, t, n, _ = x.shape
        seq = self.inp(x).permute(0, 2, 1, 3).reshape(b * n, t, -1)
        _, h = self.gru(seq)
        h = h[-1].view(b, n, -1)
        return h, attention_pool(self.score(h), self.value(h))


class HorizonDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ctx_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ctx_norm = nn.LayerNorm(cfg.hidden)
        self.gate = nn.Linear(cfg.hidden, 1)
        self.score = nn.Linear(cfg.hidden, 1)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(2 * cfg.hidden, 1)

    def forward(self, h, summary):
        ctx = self.ctx_norm(self.ctx_proj(h))
        global_ctx = ctx.mean(dim=1, keepdim=True)  # expect: AMP004
        gate = torch.sigmoid(self.gate(ctx))
        gate = gate / (gate.sum(dim=1, keepdim=True) + 1e-8)  # expect: AMP004
        local = attention_pool(self.score(ctx), self.value(ctx))
        node_feat = ctx + global_ctx + gate * ctx.size(1)
        graph_feat = (local + summary)[:, None, :].expand_as(node_feat)
        return self.out(torch.cat([node_feat, graph_feat], dim=-1)).squeeze(-1)


class GraphODEForecaster(nn.Module):
    def __init__(self, cfg, adj):
        super().__init__()
        self.encoder = TrafficEncoder(cfg)
        self.segments = nn.ModuleList(
            [ODEBlock(cfg.hidden, adj, cfg.ode_steps, cfg.solver) for _ in range(cfg.horizon)]
        )
        self.decoder = HorizonDecoder(cfg)

    def forward(self, x):
        h, summary = self.encoder(x)
        preds, kinetic = [], 0.0
        for segment in self.segments:
            h, k = segment(h)
            kinetic = kinetic + k
            preds.append(self.decoder(h, summary))
        return torch.stack(preds, dim=1), kinetic / len(self.segments)


def build_model(cfg, adj):
    return GraphODEForecaster(cfg, adj)


def masked_mae_loss(pred, target, null_val=0.0):
    mask = (target != null_val).float()
    mask = mask / mask.mean().clamp(min=1e-6)
    return ((pred - target).abs() * mask).mean()


def make_loaders(cfg, n=1024, batch_size=32):
    t = torch.arange(n + cfg.history + cfg.horizon, dtype=torch.float32)
    phase = torch.rand(cfg.num_nodes) * 6.28
    speed = 60 + 10 * torch.sin(t[:, None] / 24.0 + phase) + torch.randn(len(t), cfg.num_nodes)
    tod = (t % 288 / 288.0)[:, None].expand(-1, cfg.num_nodes)
    feats = torch.stack([(speed - 60) / 10, tod], dim=-1)
    x = torch.stack([feats[i:i + cfg.history] for i in range(n)])
    y = torch.stack([speed[i + cfg.history:i + cfg.history + cfg.horizon] for i in range(n)])
    split = int(0.8 * n)
    train = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=batch_size, shuffle=True)
    val = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=batch_size)
    return train, val


def fit(model, train_loader, val_loader, cfg):
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 30, 40], gamma=0.1)
    for epoch in range(cfg.epochs):
        model.train()
        running = 0.0
        for x, y in train_loader:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                pred, kinetic = model(x)
                loss = masked_mae_loss(pred, y) + cfg.kinetic_weight * kinetic
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            running += loss.item()
        scheduler.step()
        print(f"epoch {epoch} train_mae {running / len(train_loader):.3f} val {evaluate(model, val_loader, cfg)}")


@torch.no_grad()
def evaluate(model, loader, cfg):
    model.eval()
    abs_err, sq_err, pct_err, count = 0.0, 0.0, 0.0, 0
    for x, y in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            pred, _ = model(x)
        diff = pred.float() - y
        abs_err += diff.abs().sum().item()
        sq_err += diff.pow(2).sum().item()
        pct_err += (diff.abs() / (y.abs() + 1e-8)).sum().item()
        count += y.numel()
    return {"mae": abs_err / count, "rmse": (sq_err / count) ** 0.5, "mape": pct_err / count}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--solver", choices=sorted(SOLVERS), default="rk4")
    parser.add_argument("--fp32", action="store_true")
    args = parser.parse_args()
    cfg = ODEConfig(epochs=args.epochs, solver=args.solver, bf16=not args.fp32)
    torch.set_num_threads(8)
    adj = random_sensor_graph(cfg.num_nodes)
    model = build_model(cfg, adj)
    train_loader, val_loader = make_loaders(cfg)
    fit(model, train_loader, val_loader, cfg)
    raw = model.module if hasattr(model, "module") else model
    torch.save({"model": raw.state_dict(), "adj": adj}, "graph_ode_traffic.pt")


if __name__ == "__main__":
    main()
