"""GraphSAGE with fixed fan-out neighbour sampling on a CSR graph.

Trained jointly on node labels and on the unsupervised link objective of Hamilton et
al. (2017): an MLP decoder scores sampled edges against uniformly drawn negatives.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class NeighborSampler:
    def __init__(self, indptr, indices, fanouts, seed=0):
        self.indptr = indptr
        self.indices = indices
        self.fanouts = fanouts
        self.rng = np.random.default_rng(seed)

    def sample_layer(self, nodes, fanout):
        nbrs = np.full((len(nodes), fanout), -1, dtype=np.int64)
        for i, n in enumerate(nodes):
            start, end = self.indptr[n], self.indptr[n + 1]
            deg = end - start
            if deg == 0:
                continue
            take = self.rng.choice(deg, size=min(deg, fanout), replace=False)
            nbrs[i, : len(take)] = self.indices[start + take]
        return nbrs

    def sample(self, seeds):
        """Node list of the outermost hop and, per layer, padded local neighbour indices."""
        dst = np.asarray(seeds)
        blocks = []
        for fanout in self.fanouts:
            nbrs = self.sample_layer(dst, fanout)
            extra = np.setdiff1d(np.unique(nbrs[nbrs >= 0]), dst)
            src = np.concatenate([dst, extra])
            lookup = {int(n): i for i, n in enumerate(src)}
            local = np.array([[lookup.get(int(n), -1) for n in row] for row in nbrs], dtype=np.int64)
            local = local.reshape(len(dst), fanout)
            blocks.append((torch.from_numpy(local), torch.from_numpy(local >= 0)))
            dst = src
        blocks.reverse()
        return torch.from_numpy(dst), blocks


class SAGEConv(nn.Module):
    def __init__(self, in_dim, out_dim, aggr="mean"):
        super().__init__()
        self.aggr = aggr
        if aggr == "pool":
            self.fc_pool = nn.Linear(in_dim, in_dim)
        self.lin_self = nn.Linear(in_dim, out_dim)
        self.lin_neigh = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, h, nbr_idx, valid):
        n_dst = nbr_idx.shape[0]
        neigh = h[nbr_idx.clamp(min=0)]
        m = valid.unsqueeze(-1)
        if self.aggr == "mean":
            agg = (neigh * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        elif self.aggr == "pool":
            pooled = F.relu(self.fc_pool(neigh)) * m
            agg = pooled.mean(dim=1)  # expect: AMP004
        else:
            agg = neigh.masked_fill(~m, -1e9).amax(dim=1)  # expect: AMP007
            agg = torch.where(valid.any(dim=1, keepdim=True), agg, torch.zeros_like(agg))
        return self.lin_self(h[:n_dst]) + self.lin_neigh(agg)


class PairNorm(nn.Module):
    """PairNorm (Zhao & Akoglu, 2020): keeps deep GNN embeddings from collapsing."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        x = x - x.mean(dim=0)  # expect: AMP004
        rownorm_mean = (1e-6 + x.pow(2).sum(dim=1).mean()).sqrt()
        return self.scale * x / rownorm_mean


class GraphSAGE(nn.Module):
    def __init__(self, in_dim, hidden, num_classes, num_layers=2, aggr="pool", dropout=0.5):
        super().__init__()
        dims = [in_dim] + [hidden] * num_layers
        self.convs = nn.ModuleList([SAGEConv(dims[i], dims[i + 1], aggr) for i in range(num_layers)])
        self.norms = nn.ModuleList([PairNorm() for _ in range(num_layers - 1)])
        self.classifier = nn.Linear(hidden, num_classes)
        self.dropout = dropout

    def forward(self, x, blocks):
        h = x
        for i in range(len(self.convs)):
            nbr_idx, valid = blocks[i]
            h = self.convs[i](h, nbr_idx, valid)
            if i < len(self.convs) - 1:
                h = self.norms[i](h)
                h = F.dropout(F.relu(h), self.dropout, self.training)
        z = F.normalize(h, dim=-1)
        return z, self.classifier(z)


class EdgeDecoder(nn.Module):
    def __init__(self, dim, hidden=256):
        super().__init__()
        self.fc1 = nn.Linear(2 * dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, z_u, z_v):
        return self.fc2(F.relu(self.fc1(torch.cat([z_u, z_v], dim=-1)))).squeeze(-1)


def load_graph(path):
    npz = np.load(path)
    graph = {k: npz[k] for k in npz.files}
    graph["num_nodes"] = graph["indptr"].shape[0] - 1
    graph["num_classes"] = int(graph["labels"].max()) + 1
    deg = np.diff(graph["indptr"])
    graph["src"] = np.repeat(np.arange(graph["num_nodes"]), deg)
    graph["dst"] = graph["indices"]
    return graph


@torch.no_grad()
def evaluate(model, sampler, feats, labels, nodes, device, batch_size=4096):
    model.eval()
    correct = 0
    for start in range(0, len(nodes), batch_size):
        seeds = nodes[start:start + batch_size]
        input_nodes, blocks = sampler.sample(seeds)
        blocks = [(idx.to(device), valid.to(device)) for idx, valid in blocks]
        with torch.autocast("cuda", dtype=torch.float16):
            _, logits = model(feats[input_nodes.to(device)], blocks)
        correct += (logits.argmax(-1) == labels[torch.from_numpy(seeds).to(device)]).sum().item()
    model.train()
    return correct / max(len(nodes), 1)


def train(args):
    device = torch.device("cuda")
    graph = load_graph(args.data)
    # the feature matrix of the large graphs does not fit on one GPU in fp32
    feats = torch.from_numpy(graph["feat"]).to(device).half()  # expect: AMP001
    labels = torch.from_numpy(graph["labels"]).to(device)
    sampler = NeighborSampler(graph["indptr"], graph["indices"], args.fanouts, seed=args.seed)
    eval_sampler = NeighborSampler(graph["indptr"], graph["indices"], [f * 2 for f in args.fanouts], seed=args.seed + 1)
    model = GraphSAGE(feats.shape[1], args.hidden, graph["num_classes"], len(args.fanouts), args.aggr).to(device)
    decoder = EdgeDecoder(args.hidden).to(device)
    optimizer = torch.optim.Adam(list(model.parameters()) + list(decoder.parameters()), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")
    src, dst = graph["src"], graph["dst"]
    rng = np.random.default_rng(args.seed)
    for epoch in range(args.epochs):
        model.train()
        perm = rng.permutation(len(src))[: args.edges_per_epoch]
        tic, total = time.time(), 0.0
        for start in range(0, len(perm), args.batch_size):
            eids = perm[start:start + args.batch_size]
            u, v = src[eids], dst[eids]
            neg = rng.integers(0, graph["num_nodes"], size=len(eids))
            input_nodes, blocks = sampler.sample(np.concatenate([u, v, neg]))
            blocks = [(idx.to(device), valid.to(device)) for idx, valid in blocks]
            x = feats[input_nodes.to(device)]
            b = len(eids)
            with torch.autocast("cuda", dtype=torch.float16):
                z, logits = model(x, blocks)
                pos_score = decoder(z[:b], z[b:2 * b])
                neg_score = decoder(z[:b], z[2 * b:])
                pos_loss = -torch.log(torch.sigmoid(pos_score) + 1e-15).mean()  # expect: AMP011
                neg_loss = -torch.log(1 - torch.sigmoid(neg_score) + 1e-15).mean()  # expect: AMP011
                sup = F.cross_entropy(logits[:b], labels[torch.from_numpy(u).to(device)])
                loss = pos_loss + neg_loss + args.sup_weight * sup
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            total += loss.item()
        acc = evaluate(model, eval_sampler, feats, labels, graph["val_idx"], device)
        print(f"epoch {epoch}: loss {total:.3f} val acc {acc:.4f} ({time.time() - tic:.1f}s)")
    torch.save({"model": model.state_dict(), "decoder": decoder.state_dict()}, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="sage.pt")
    p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--aggr", choices=["mean", "pool", "max"], default="pool")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--edges-per-epoch", type=int, default=500_000)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sup-weight", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args())
