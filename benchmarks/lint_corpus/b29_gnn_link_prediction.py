"""Link prediction on a citation graph with GIN + GAT message passing.

Message passing is written with plain index_add / scatter_reduce so it runs
without torch_scatter. Layout follows the OGB link-prediction examples: an
encoder over the full graph, a pairwise predictor, and a loop over batches of
positive training edges with random negatives.
"""
import argparse
import math
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


def scatter_sum(src, index, dim_size):
    out = src.new_zeros((dim_size,) + tuple(src.shape[1:]))
    return out.index_add_(0, index, src)


def edge_softmax(scores, index, num_nodes):
    """Softmax of per-edge scores over the incoming edges of every node."""
    idx = index.view(-1, *([1] * (scores.dim() - 1))).expand_as(scores)
    smax = scores.new_full((num_nodes,) + tuple(scores.shape[1:]), -1e9)  # expect: AMP007
    smax = smax.scatter_reduce(0, idx, scores.detach(), reduce="amax", include_self=True)
    exp = torch.exp(scores - smax.gather(0, idx))
    denom = scatter_sum(exp, index, num_nodes)
    return exp / (denom.gather(0, idx) + 1e-16)


class GINLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.eps = nn.Parameter(torch.zeros(1))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, edge_index):
        src, dst = edge_index
        aggr = scatter_sum(x[src], dst, x.size(0))
        return self.mlp((1 + self.eps) * x + aggr)


class PairNorm(nn.Module):
    """PairNorm (Zhao & Akoglu, 2020), PN mode."""

    def __init__(self, scale=1.0, eps=1e-5):
        super().__init__()
        self.scale = scale
        self.eps = eps

    def forward(self, x):
        col_mean = x.mean(dim=0)  # expect: AMP004
        x = x - col_mean
        rownorm_mean = (self.eps + x.pow(2).sum(dim=1).mean()).sqrt()
        return self.scale * x / rownorm_mean


class GATLayer(nn.Module):
    def __init__(self, in_dim, out_dim, heads=4, dropout=0.1, negative_slope=0.2):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.negative_slope = negative_slope
        self.fc = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.attn_fc = nn.Linear(2 * out_dim, 1, bias=False)
        self.res_fc = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.attn_drop = nn.Dropout(dropout)

    def _edge_scores(self, z, src, dst):
        pair = torch.cat([z[src], z[dst]], dim=-1)
        return F.leaky_relu(self.attn_fc(pair).squeeze(-1), self.negative_slope)

    def forward(self, x, edge_index):
        src, dst = edge_index
        n = x.size(0)
        z = self.fc(x).view(n, self.heads, self.out_dim)
        scores = self._edge_scores(z, src, dst)
        alpha = self.attn_drop(edge_softmax(scores, dst, n))
        out = scatter_sum(z[src] * alpha.unsqueeze(-1), dst, n)
        return out.reshape(n, -1) + self.res_fc(x)


class HybridEncoder(nn.Module):
    """GIN layers with PairNorm and a virtual node, followed by one GAT layer."""

    def __init__(self, in_dim, hidden, num_layers=3, heads=4, dropout=0.2):
        super().__init__()
        self.dropout = dropout
        self.node_encoder = nn.Linear(in_dim, hidden)
        self.convs = nn.ModuleList([GINLayer(hidden) for _ in range(num_layers)])
        self.norms = nn.ModuleList([PairNorm() for _ in range(num_layers)])
        self.vn_emb = nn.Parameter(torch.zeros(1, hidden))
        self.vn_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.gat = GATLayer(hidden, hidden // heads, heads=heads, dropout=dropout)

    def forward(self, x, edge_index):
        h = F.relu(self.node_encoder(x))
        vn = self.vn_emb
        for conv, norm in zip(self.convs, self.norms):
            h = h + vn
            out = conv(h, edge_index)
            vn = vn + self.vn_mlp(out.mean(dim=0, keepdim=True))  # expect: AMP004
            h = F.dropout(F.relu(norm(out)), p=self.dropout, training=self.training)
        return self.gat(h, edge_index)


class LinkPredictor(nn.Module):
    def __init__(self, in_dim, hidden, num_layers=3, dropout=0.0):
        super().__init__()
        dims = [in_dim] + [hidden] * (num_layers - 1) + [1]
        self.lins = nn.ModuleList([nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.dropout = dropout

    def forward(self, x_i, x_j):
        x = x_i * x_j
        for lin in self.lins[:-1]:
            x = F.dropout(F.relu(lin(x)), p=self.dropout, training=self.training)
        return torch.sigmoid(self.lins[-1](x))


ENCODERS = {"gin-gat": HybridEncoder}


def build_encoder(args, in_dim):
    return ENCODERS[args.encoder](in_dim, args.hidden, num_layers=args.num_layers, dropout=args.dropout)


def train(model, predictor, data, split_edge, optimizer, scaler, batch_size, device):
    model.train()
    predictor.train()
    x = data["x"].to(device).half()  # expect: AMP001
    edge_index = data["edge_index"].to(device)
    pos_train_edge = split_edge["train"]["edge"].to(device)
    params = list(model.parameters()) + list(predictor.parameters())

    total_loss = total_examples = 0
    for perm in DataLoader(range(pos_train_edge.size(0)), batch_size, shuffle=True):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            h = model(x, edge_index)
            edge = pos_train_edge[perm].t()
            pos_out = predictor(h[edge[0]], h[edge[1]])
            pos_loss = -torch.log(pos_out + 1e-15).mean()  # expect: AMP011
            edge = torch.randint(0, x.size(0), edge.size(), dtype=torch.long, device=device)
            neg_out = predictor(h[edge[0]], h[edge[1]])
            neg_loss = -torch.log(1 - neg_out + 1e-15).mean()  # expect: AMP011
            loss = pos_loss + neg_loss
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()

        num_examples = pos_out.size(0)
        total_loss += loss.item() * num_examples
        total_examples += num_examples
    return total_loss / total_examples


@torch.no_grad()
def test(model, predictor, data, split_edge, batch_size, device):
    model.eval()
    predictor.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        h = model(data["x"].to(device).half(), data["edge_index"].to(device))

    def score(edges):
        preds = []
        for perm in DataLoader(range(edges.size(0)), batch_size):
            e = edges[perm].t()
            with torch.autocast("cuda", dtype=torch.float16):
                preds.append(predictor(h[e[0]], h[e[1]]).squeeze(-1).cpu())
        return torch.cat(preds, dim=0)

    pos_valid = score(split_edge["valid"]["edge"].to(device))
    neg_valid = score(split_edge["valid"]["edge_neg"].to(device))
    results: Dict[str, float] = {"pos_mean": float(pos_valid.mean()), "neg_mean": float(neg_valid.mean())}
    for k in (10, 50, 100):
        kth = torch.topk(neg_valid, k)[0][-1]
        results[f"hits@{k}"] = float((pos_valid > kth).float().mean())
    return results


def main():
    parser = argparse.ArgumentParser(description="link prediction (GIN+GAT)")
    parser.add_argument("--data", default="data/citation2_graph.pt")
    parser.add_argument("--encoder", default="gin-gat")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--batch-size", type=int, default=64 * 1024)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=5)
    args = parser.parse_args()

    device = torch.device("cuda")
    blob = torch.load(args.data)
    data, split_edge = blob["data"], blob["split_edge"]

    model = build_encoder(args, data["x"].size(-1)).to(device)
    predictor = LinkPredictor(args.hidden, args.hidden, dropout=args.dropout).to(device)
    optimizer = torch.optim.Adam(list(model.parameters()) + list(predictor.parameters()), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")

    best = {"hits@50": 0.0}
    for epoch in range(1, args.epochs + 1):
        loss = train(model, predictor, data, split_edge, optimizer, scaler, args.batch_size, device)
        if epoch % args.eval_steps == 0:
            results = test(model, predictor, data, split_edge, args.batch_size, device)
            if results["hits@50"] > best["hits@50"]:
                best = results
                torch.save({"model": model.state_dict(), "predictor": predictor.state_dict()}, "best_lp.pt")
            print(f"epoch {epoch:03d} loss {loss:.4f} " + " ".join(f"{k} {v:.4f}" for k, v in results.items()))
    print("best", best)


if __name__ == "__main__":
    main()
