"""Conditional continuous normalizing flow (FFJORD-style) over 3-D points.

Each sample x is a point conditioned on a context point set (the rest of the
shape).  The dynamics f(t, z, c) are an MLP; log-density change uses the
Hutchinson trace estimator; a kinetic-energy penalty (RNODE) keeps the
trajectories straight.  Integration: fixed-step RK4 written out as methods.

Runs on CPU with bf16 autocast (no GradScaler: bf16 needs none).
"""
import argparse
import math
from collections import namedtuple

import torch
import torch.nn as nn

FlowOutput = namedtuple("FlowOutput", ["log_px", "kinetic", "z"])


def standard_normal_logprob(z):
    return -0.5 * (math.log(2 * math.pi) + z.pow(2))


class ContextEncoder(nn.Module):
    """Per-point DeepSets features of the conditioning set."""

    def __init__(self, in_dim, ctx_dim):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(in_dim, 128), nn.SiLU(), nn.Linear(128, ctx_dim))
        self.norm = nn.LayerNorm(ctx_dim)

    def forward(self, pts):  # [B, M, in_dim]
        return self.norm(self.phi(pts))


class TimeConditionedMLP(nn.Module):
    def __init__(self, dim, ctx_dim, hidden, n_hidden):
        super().__init__()
        layers = [nn.Linear(dim + 1 + ctx_dim, hidden), nn.Softplus()]
        for _ in range(n_hidden - 1):
            layers += [nn.Linear(hidden, hidden), nn.Softplus()]
        layers.append(nn.Linear(hidden, dim))
        self.net = nn.Sequential(*layers)

    def forward(self, t, z, ctx):
        tz = torch.cat([z, t.expand(z.size(0), 1), ctx], dim=-1)
        return self.net(tz)


class ODEFunc(nn.Module):
    def __init__(self, dim, ctx_dim, hidden, n_hidden):
        super().__init__()
        self.diffeq = TimeConditionedMLP(dim, ctx_dim, hidden, n_hidden)

    def forward(self, t, z, ctx, noise):
        with torch.enable_grad():
            z = z.requires_grad_(True)
            dz = self.diffeq(t, z, ctx)
            vjp = torch.autograd.grad(dz, z, noise.to(dz.dtype), create_graph=self.training)[0]
        div = (vjp * noise).sum(dim=-1)
        kinetic = (dz * dz).sum(dim=-1)  # expect: AMP004
        return dz, div, kinetic


class ConditionalCNF(nn.Module):
    def __init__(self, dim=3, ctx_dim=64, hidden=256, n_hidden=3, steps=8, horizon=1.0):
        super().__init__()
        self.context = ContextEncoder(dim, ctx_dim)
        self.pool_score = nn.Linear(ctx_dim, 1)
        self.odefunc = ODEFunc(dim, 2 * ctx_dim, hidden, n_hidden)
        self.steps = steps
        self.horizon = horizon

    def _pool(self, feats):
        pooled = feats.mean(dim=1)  # expect: AMP004
        w = torch.softmax(self.pool_score(feats), dim=1)
        attn_pooled = (w * feats).sum(dim=1)  # expect: AMP004
        return torch.cat([pooled, attn_pooled], dim=-1)

    def _rk4_step(self, t, z, ctx, noise, dt):
        k1 = self.odefunc(t, z, ctx, noise)
        k2 = self.odefunc(t + dt / 2, z + dt / 2 * k1[0], ctx, noise)
        k3 = self.odefunc(t + dt / 2, z + dt / 2 * k2[0], ctx, noise)
        k4 = self.odefunc(t + dt, z + dt * k3[0], ctx, noise)
        return [(a + 2 * b + 2 * c + d) * dt / 6 for a, b, c, d in zip(k1, k2, k3, k4)]

    def _integrate(self, z, ctx, noise):
        b = z.size(0)
        delta_logp = torch.zeros(b, device=z.device)
        kinetic = torch.zeros(b, device=z.device)
        dt = self.horizon / self.steps
        t = torch.zeros(1, device=z.device)
        for _ in range(self.steps):
            dz, ddiv, dkin = self._rk4_step(t, z, ctx, noise, dt)
            z = z + dz
            delta_logp = delta_logp + ddiv
            kinetic = kinetic + dkin
            t = t + dt
        return z, delta_logp, kinetic

    def forward(self, x, cond):
        ctx = self._pool(self.context(cond))
        noise = torch.randn_like(x)
        z1, delta_logp, kinetic = self._integrate(x, ctx, noise)
        log_pz = standard_normal_logprob(z1).sum(dim=-1)
        return FlowOutput(log_px=log_pz + delta_logp, kinetic=kinetic, z=z1)


def build_cnf(args):
    return ConditionalCNF(
        dim=3, ctx_dim=args.ctx_dim, hidden=args.hidden, n_hidden=args.n_hidden, steps=args.steps
    )


def train(model, loader, epochs, lr=1e-3, kinetic_weight=0.01, log_every=20):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(loader))
    model.train()
    step = 0
    for epoch in range(epochs):
        for x, cond in loader:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                out = model(x, cond)
                nll = -out.log_px.mean()
                loss = nll + kinetic_weight * out.kinetic.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            sched.step()
            if step % log_every == 0:
                bpd = nll.item() / (x.size(-1) * math.log(2))
                print(f"epoch {epoch} step {step} nll {nll.item():.4f} bits/dim {bpd:.3f}")
            step += 1


@torch.no_grad()
def evaluate_nll(model, loader):
    model.eval()
    total, n = 0.0, 0
    for x, cond in loader:
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            out = model(x, cond)
        total += -out.log_px.float().sum().item()
        n += x.size(0)
    model.train()
    return total / max(n, 1)


def make_shapes(n_shapes, points_per_shape, ctx_points):
    """Noisy points on randomly scaled ellipsoids; each sample: (point, context set)."""
    data = []
    for _ in range(n_shapes):
        axes = 0.5 + torch.rand(3)
        pts = torch.randn(points_per_shape + ctx_points, 3)
        pts = pts / pts.norm(dim=-1, keepdim=True) * axes
        pts = pts + 0.01 * torch.randn_like(pts)
        data.append((pts[:points_per_shape], pts[points_per_shape:]))
    return data


def make_loader(data, batch_size):
    batches = []
    for shape_pts, ctx in data:
        for i in range(0, shape_pts.size(0), batch_size):
            x = shape_pts[i:i + batch_size]
            cond = ctx.unsqueeze(0).expand(x.size(0), -1, -1)
            batches.append((x, cond))
    return batches


def main():
    parser = argparse.ArgumentParser(description="conditional CNF on CPU (bf16 autocast)")
    parser.add_argument("--ctx-dim", dest="ctx_dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--n-hidden", dest="n_hidden", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train_loader = make_loader(make_shapes(64, 2048, 512), args.batch_size)
    val_loader = make_loader(make_shapes(8, 2048, 512), args.batch_size)
    model = build_cnf(args)
    train(model, train_loader, args.epochs)
    print(f"val nll/pt {evaluate_nll(model, val_loader):.4f}")
    torch.save(model.state_dict(), "cnf.pt")


if __name__ == "__main__":
    main()
