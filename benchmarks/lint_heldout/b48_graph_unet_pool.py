"""Graph U-Net (Gao & Ji, 2019) with gPool / gUnpool for binary graph classification
(PROTEINS / D&D style dense graphs, one graph per forward pass, gradients accumulated over
a mini-batch of graphs).
"""
import argparse
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class GCNLayer(nn.Module):
    def __init__(self, in_dim, out_dim, dropout=0.3):
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, h, adj):
        deg = adj.sum(-1, keepdim=True).clamp(min=1.0)
        h = torch.matmul(adj, h) / deg
        return self.lin(self.drop(h))


class GraphNorm(nn.Module):
    """Normalise node features over the nodes of the graph (Cai et al., 2021, without the shift)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(dim=0, keepdim=True)  # expect: AMP004
        var = x.var(dim=0, unbiased=False, keepdim=True)  # expect: AMP004
        x = (x - mean) / torch.sqrt(var + 1e-10)  # expect: AMP011
        return x * self.weight + self.bias


class GraphPool(nn.Module):
    def __init__(self, ratio, dim):
        super().__init__()
        self.ratio = ratio
        self.p = nn.Parameter(torch.randn(dim) / dim ** 0.5)

    def forward(self, h, adj):
        scores = torch.matmul(h, self.p) / (self.p.norm() + 1e-8)
        n_keep = max(2, int(self.ratio * h.shape[0]))
        values, idx = torch.topk(scores, n_keep)
        h = h[idx] * torch.sigmoid(values).unsqueeze(-1)
        adj = adj[idx][:, idx]
        return h, adj, idx


class GraphUnpool(nn.Module):
    def forward(self, h, n_nodes, idx):
        new_h = h.new_zeros(n_nodes, h.shape[1])
        new_h[idx] = h
        return new_h


class GraphUNet(nn.Module):
    def __init__(self, in_dim, hid=128, ratios=(0.9, 0.7, 0.6, 0.5), dropout=0.3):
        super().__init__()
        self.start_gcn = GCNLayer(in_dim, hid, dropout)
        self.start_norm = GraphNorm(hid)
        self.down_gcns = nn.ModuleList(GCNLayer(hid, hid, dropout) for _ in ratios)
        self.down_norms = nn.ModuleList(GraphNorm(hid) for _ in ratios)
        self.pools = nn.ModuleList(GraphPool(r, hid) for r in ratios)
        self.bottom_gcn = GCNLayer(hid, hid, dropout)
        self.up_gcns = nn.ModuleList(GCNLayer(hid, hid, dropout) for _ in ratios)
        self.up_norms = nn.ModuleList(GraphNorm(hid) for _ in ratios)
        self.unpool = GraphUnpool()
        self.end_gcn = GCNLayer(2 * hid, hid, dropout)
        self.classifier = nn.Sequential(nn.Linear(2 * hid, hid), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hid, 1))

    def link_reconstruction(self, h, adj):
        # graph auto-encoder style auxiliary loss on the coarsest graph
        rec = torch.sigmoid(h @ h.t())
        pos = -torch.log(rec + 1e-10)[adj > 0].mean()  # expect: AMP011
        neg = -torch.log(1 - rec + 1e-10)[adj == 0].mean()  # expect: AMP011
        return pos + neg

    @staticmethod
    def augment(adj):
        # connect 2-hop neighbours before pooling so the pooled graph stays connected
        return ((torch.matmul(adj, adj) + adj) > 0).float()

    def forward(self, x, adj):
        h = F.elu(self.start_norm(self.start_gcn(x, adj)))
        org_h = h
        skips, adjs, indices = [], [], []
        for gcn, norm, pool in zip(self.down_gcns, self.down_norms, self.pools):
            h = F.elu(norm(gcn(h, adj)))
            skips.append(h)
            adjs.append(adj)
            h, adj, idx = pool(h, self.augment(adj))
            indices.append(idx)
        h = F.elu(self.bottom_gcn(h, adj))
        rec_loss = self.link_reconstruction(h, adj)
        for i, (gcn, norm) in enumerate(zip(self.up_gcns, self.up_norms)):
            j = len(skips) - 1 - i
            adj, idx = adjs[j], indices[j]
            h = self.unpool(h, adj.shape[0], idx)
            h = F.elu(norm(gcn(h, adj))) + skips[j]
        h = self.end_gcn(torch.cat([h, org_h], dim=-1), adj)
        # sum readout (GIN) followed by max readout
        g = torch.cat([h.sum(dim=0), h.max(dim=0).values], dim=-1)
        return torch.sigmoid(self.classifier(g)).squeeze(-1), rec_loss


def load_graphs(path):
    data = np.load(path, allow_pickle=True)
    graphs = []
    for feats, adj, label in zip(data["x"], data["adj"], data["y"]):
        graphs.append((torch.from_numpy(feats).float(), torch.from_numpy(adj).float(), float(label)))
    return graphs


def train(args):
    device = torch.device("cuda")
    graphs = load_graphs(args.data)
    random.shuffle(graphs)
    split = int(0.9 * len(graphs))
    train_set, val_set = graphs[:split], graphs[split:]
    model = GraphUNet(in_dim=train_set[0][0].shape[1], hid=args.hid).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        random.shuffle(train_set)
        running = 0.0
        for start in range(0, len(train_set), args.batch):
            optimizer.zero_grad(set_to_none=True)
            for x, adj, y in train_set[start:start + args.batch]:
                x, adj = x.to(device), adj.to(device)
                target = torch.tensor(y, device=device)
                with amp_ctx:
                    prob, rec_loss = model(x, adj)
                    loss = F.binary_cross_entropy(prob, target)  # expect: AMP003
                    loss = (loss + args.rec_weight * rec_loss) / args.batch
                loss.backward()
                running += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            optimizer.step()
        acc = evaluate(model, val_set, device, args.amp)
        best_acc = max(best_acc, acc)
        print(f"epoch {epoch:3d} loss {running:.4f} val acc {acc:.4f} best {best_acc:.4f}")
    return best_acc


@torch.no_grad()
def evaluate(model, graphs, device, use_amp):
    model.eval()
    correct = 0
    for x, adj, y in graphs:
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            prob, _ = model(x.to(device), adj.to(device))
        correct += int((prob.item() > 0.5) == (y > 0.5))
    return correct / max(len(graphs), 1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="proteins_dense.npz")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--hid", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rec-weight", dest="rec_weight", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=200)
    train(p.parse_args())
