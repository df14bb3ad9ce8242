"""Hyperbolic link prediction on a hierarchy in the Poincare ball.

Every node has a free embedding in the ball (Nickel & Kiela, 2017) and a feature vector.
An MLP maps the features to the tangent space at the origin, the exponential map puts
them on the ball, and a Mobius addition combines them with the free embedding.  Edges
are scored by the Fermi-Dirac decoder on the hyperbolic distance (HGCN, Chami et al.,
2019) with a per-pair temperature predicted from the two tangent vectors.
Mixed precision: fp16 autocast for the encoder, the ball arithmetic itself is fp32.
With --fp16-table the (large) embedding table is stored in fp16; its gradients cannot be
unscaled by the GradScaler, so loss scaling is switched off in that mode.
"""
import argparse
import itertools

import numpy as np
import torch
import torch.nn as nn


def artanh(x):
    x = x.clamp(-1.0 + 1e-7, 1.0 - 1e-7)
    return 0.5 * (torch.log1p(x) - torch.log1p(-x))


def expmap0(v, c):
    sqrt_c = c ** 0.5
    v_norm = v.norm(dim=-1, keepdim=True).clamp_min(1e-15)
    return torch.tanh(sqrt_c * v_norm) * v / (sqrt_c * v_norm)


def project(x, c, boundary_eps=4e-3):
    norm = x.norm(dim=-1, keepdim=True).clamp_min(1e-15)
    maxnorm = (1.0 - boundary_eps) / c ** 0.5
    return torch.where(norm > maxnorm, x / norm * maxnorm, x)


def mobius_add(x, y, c):
    x2 = x.pow(2).sum(dim=-1, keepdim=True)
    y2 = y.pow(2).sum(dim=-1, keepdim=True)
    xy = (x * y).sum(dim=-1, keepdim=True)
    num = (1.0 + 2.0 * c * xy + c * y2) * x + (1.0 - c * x2) * y
    denom = 1.0 + 2.0 * c * xy + c * c * x2 * y2
    return num / denom.clamp_min(1e-15)


def poincare_dist(x, y, c):
    sqrt_c = c ** 0.5
    diff = mobius_add(-x, y, c)
    return 2.0 / sqrt_c * artanh(sqrt_c * diff.norm(dim=-1))


class TangentEncoder(nn.Module):
    def __init__(self, in_dim, hidden, dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, feats):
        v = self.mlp(feats)
        # max-abs scaling keeps tanh(|v|) away from saturation at the ball's boundary
        return v / (v.abs().amax(dim=-1, keepdim=True) + 1e-8)  # expect: AMP011


class FermiDirac(nn.Module):
    """p(edge) = 1 / (exp((d - r) / t) + 1) with a learned radius and per-pair temperature."""

    def __init__(self, dim, t_max=2.0):
        super().__init__()
        self.r = nn.Parameter(torch.tensor(2.0))
        self.temp_head = nn.Linear(2 * dim, 1)
        self.t_max = t_max

    def forward(self, dist, v_u, v_v):
        logit_t = self.temp_head(torch.cat([v_u, v_v], dim=-1)).squeeze(-1)
        t = self.t_max * torch.sigmoid(logit_t) + 1e-10  # expect: AMP011
        return torch.sigmoid((self.r - dist) / t)


class HyperbolicLinkModel(nn.Module):
    def __init__(self, n_nodes, feat_dim, dim=16, hidden=64, c=1.0):
        super().__init__()
        self.c = c
        self.table = nn.Embedding(n_nodes, dim)
        nn.init.uniform_(self.table.weight, -1e-3, 1e-3)
        self.encoder = TangentEncoder(feat_dim, hidden, dim)
        self.decoder = FermiDirac(dim)

    def embed(self, idx, feats):
        v = self.encoder(feats[idx])
        p_feat = expmap0(v, self.c)
        p_table = project(self.table(idx).float(), self.c)
        return project(mobius_add(p_table, p_feat, self.c), self.c), v

    def forward(self, src, dst, feats):
        x_u, v_u = self.embed(src, feats)
        x_v, v_v = self.embed(dst, feats)
        return self.decoder(poincare_dist(x_u, x_v, self.c), v_u, v_v)


def build(args, n_nodes, feat_dim, device):
    model = HyperbolicLinkModel(n_nodes, feat_dim, args.dim, args.hidden, args.curvature).to(device)
    if args.fp16_table:
        model.table.half()
    table_opt = torch.optim.Adam(model.table.parameters(), lr=args.table_lr, eps=1e-8)  # expect: AMP011
    net_params = itertools.chain(model.encoder.parameters(), model.decoder.parameters())
    net_opt = torch.optim.AdamW(net_params, lr=args.lr, weight_decay=1e-4, eps=1e-8)
    return model, table_opt, net_opt


def make_hierarchy(branching=3, depth=6, feat_dim=32, seed=0):
    rng = np.random.default_rng(seed)
    parents, depths = [-1], [0]
    frontier = [0]
    for d in range(1, depth):
        nxt = []
        for p in frontier:
            for _ in range(branching):
                parents.append(p)
                depths.append(d)
                nxt.append(len(parents) - 1)
        frontier = nxt
    edges = []
    for i in range(1, len(parents)):
        a = parents[i]
        while a >= 0:
            edges.append((i, a))
            a = parents[a]
    feats = rng.normal(size=(len(parents), feat_dim)).astype(np.float32)
    feats[:, 0] = np.asarray(depths, dtype=np.float32) / depth
    return torch.tensor(edges, dtype=torch.long), torch.from_numpy(feats)


@torch.no_grad()
def evaluate(model, edges, feats, device, max_edges=2000):
    model.eval()
    all_idx = torch.arange(feats.size(0), device=device)
    x_all, _ = model.embed(all_idx, feats)
    ranks = []
    for u, v in edges[:max_edges].tolist():
        d = poincare_dist(x_all[u].expand_as(x_all), x_all, model.c)
        d[u] = float("inf")
        ranks.append(int((d < d[v]).sum().item()) + 1)
    model.train()
    ranks = np.asarray(ranks, dtype=np.float64)
    return float(ranks.mean()), float(np.mean(1.0 / ranks))


def train(args):
    device = torch.device("cuda")
    edges, feats = make_hierarchy(args.branching, args.depth)
    feats = feats.to(device)
    n_nodes = feats.size(0)
    model, table_opt, net_opt = build(args, n_nodes, feats.size(1), device)
    scaler = torch.amp.GradScaler("cuda", enabled=not args.fp16_table)
    criterion = nn.BCELoss()

    for epoch in range(args.epochs):
        perm = torch.randperm(edges.size(0))
        running = 0.0
        for i in range(0, edges.size(0), args.batch_size):
            batch = edges[perm[i:i + args.batch_size]].to(device)
            u, v = batch[:, 0], batch[:, 1]
            neg = torch.randint(0, n_nodes, (u.size(0), args.negatives), device=device)
            src = torch.cat([u, u.repeat_interleave(args.negatives)])
            dst = torch.cat([v, neg.flatten()])
            labels = torch.cat([torch.ones(u.size(0)), torch.zeros(neg.numel())]).to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                probs = model(src, dst, feats)
                loss = criterion(probs, labels)  # expect: AMP003

            table_opt.zero_grad(set_to_none=True)
            net_opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(net_opt)
            torch.nn.utils.clip_grad_norm_(model.encoder.parameters(), 1.0)
            scaler.step(table_opt)
            scaler.step(net_opt)
            scaler.update()
            with torch.no_grad():
                w = model.table.weight
                w.copy_(project(w.float(), model.c).to(w.dtype))
            running += loss.item() * u.size(0)

        if epoch % args.eval_every == 0:
            mean_rank, mrr = evaluate(model, edges, feats, device)
            print(f"epoch {epoch}: loss {running / edges.size(0):.4f} "
                  f"mean rank {mean_rank:.2f} MRR {mrr:.4f} r {model.decoder.r.item():.3f}")
    return model


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--branching", type=int, default=3)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--curvature", type=float, default=1.0)
    p.add_argument("--negatives", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--table-lr", type=float, default=1e-2)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--fp16-table", action="store_true")
    p.add_argument("--out", default="poincare.pt")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = train(args)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
