"""GraphSAGE (Hamilton et al., 2017) with layer-wise uniform neighbour sampling.

SAGE layers in the DGL style (one layer class, aggregator chosen by name: mean, gcn, pool,
attn), optional PairNorm between layers, models picked from a registry.  Trains on CPU
under bfloat16 autocast, which needs no loss scaling.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def load_graph(path):
    data = np.load(path)
    indptr, indices = data["indptr"], data["indices"]
    feats = torch.from_numpy(data["feats"]).float()
    feats = (feats - feats.mean(dim=0)) / (feats.std(dim=0) + 1e-8)
    labels = torch.from_numpy(data["labels"]).long()
    split = {k: torch.from_numpy(data[f"{k}_idx"]).long() for k in ("train", "val", "test")}
    deg = np.diff(indptr)
    print(f"nodes {len(indptr) - 1} edges {len(indices)} mean degree {deg.mean():.1f} (std {deg.std():.1f})")
    return indptr, indices, feats, labels, split


class NeighborSampler:
    """Uniform fixed-fanout sampling on a CSR graph; returns per-layer index maps."""

    def __init__(self, indptr, indices, fanouts, seed=0):
        self.indptr, self.indices, self.fanouts = indptr, indices, fanouts
        self.rng = np.random.default_rng(seed)

    def sample_layer(self, nodes, fanout):
        nbrs = np.empty((len(nodes), fanout), dtype=np.int64)
        for i, n in enumerate(nodes):
            start, end = self.indptr[n], self.indptr[n + 1]
            if end == start:
                nbrs[i] = n
            else:
                nbrs[i] = self.indices[start + self.rng.integers(0, end - start, size=fanout)]
        return nbrs

    def sample(self, seeds):
        nodes = np.asarray(seeds)
        frontiers, maps = [nodes], []
        for fanout in self.fanouts:
            nbrs = self.sample_layer(nodes, fanout)
            frontier, inverse = np.unique(np.concatenate([nodes, nbrs.ravel()]), return_inverse=True)
            maps.append((torch.from_numpy(inverse[:len(nodes)]),
                         torch.from_numpy(inverse[len(nodes):].reshape(len(nodes), fanout))))
            frontiers.append(frontier)
            nodes = frontier
        return frontiers[-1], maps[::-1]


class SAGELayer(nn.Module):
    def __init__(self, in_dim, out_dim, aggregator_type="mean", activation=True, dropout=0.0):
        super().__init__()
        self.aggregator_type = aggregator_type
        self.fc_neigh = nn.Linear(in_dim, out_dim)
        if aggregator_type != "gcn":
            self.fc_self = nn.Linear(in_dim, out_dim, bias=False)
        if aggregator_type == "pool":
            self.fc_pool = nn.Linear(in_dim, in_dim)
        if aggregator_type == "attn":
            self.attn = nn.Linear(2 * out_dim, 1, bias=False)
        self.activation = activation
        self.feat_drop = nn.Dropout(dropout)

    def forward(self, h_self, h_nbr):
        h_self, h_nbr = self.feat_drop(h_self), self.feat_drop(h_nbr)
        if self.aggregator_type == "mean":
            h_neigh = self.fc_neigh(h_nbr).mean(dim=1)  # expect: AMP004
        elif self.aggregator_type == "pool":
            h_neigh = self.fc_neigh(F.relu(self.fc_pool(h_nbr)).max(dim=1).values)
        elif self.aggregator_type == "attn":
            z = self.fc_neigh(h_nbr)
            z_self = self.fc_neigh(h_self).unsqueeze(1).expand_as(z)
            e = F.leaky_relu(self.attn(torch.cat([z_self, z], dim=-1)).squeeze(-1), 0.2)
            alpha = torch.softmax(e, dim=1)
            h_neigh = (alpha.unsqueeze(-1) * z).sum(dim=1)  # expect: AMP004
        elif self.aggregator_type == "gcn":
            h = self.fc_neigh(torch.cat([h_self.unsqueeze(1), h_nbr], dim=1))
            rst = h.sum(dim=1) / (h_nbr.shape[1] + 1)  # expect: AMP004
            return F.relu(rst) if self.activation else rst
        else:
            raise KeyError(self.aggregator_type)
        rst = self.fc_self(h_self) + h_neigh
        return F.relu(rst) if self.activation else rst


class PairNorm(nn.Module):
    """Zhao & Akoglu, 2020.  PN: center, rescale to a constant mean row norm;
    PN-SI: rescale each row; PN-SCS: rescale each row, then center."""

    def __init__(self, mode="PN", scale=1.0):
        super().__init__()
        assert mode in ("PN", "PN-SI", "PN-SCS")
        self.mode, self.scale = mode, scale

    def forward(self, x):
        col_mean = x.mean(dim=0)  # expect: AMP004
        if self.mode == "PN":
            x = x - col_mean
            rownorm_mean = (1e-6 + x.float().pow(2).sum(dim=1).mean()).sqrt()
            return self.scale * x / rownorm_mean
        if self.mode == "PN-SI":
            x = x - col_mean
        rownorm_individual = (1e-6 + x.pow(2).sum(dim=1, keepdim=True)).sqrt()  # expect: AMP004
        x = self.scale * x / rownorm_individual
        return x - col_mean if self.mode == "PN-SCS" else x


class GraphSAGE(nn.Module):
    def __init__(self, cfg, pair_norm=None):
        super().__init__()
        dims = [cfg["in_dim"]] + [cfg["hidden"]] * (cfg["num_layers"] - 1) + [cfg["num_classes"]]
        self.layers = nn.ModuleList([
            SAGELayer(dims[i], dims[i + 1], cfg["aggregator"], activation=i < len(dims) - 2, dropout=cfg["dropout"])
            for i in range(len(dims) - 1)
        ])
        self.norms = nn.ModuleList([PairNorm(pair_norm) if pair_norm else nn.Identity() for _ in range(len(dims) - 2)])

    def forward(self, x, blocks):
        h = x
        for i, (layer, (self_idx, nbr_idx)) in enumerate(zip(self.layers, blocks)):
            h = layer(h[self_idx], h[nbr_idx])
            if i < len(self.layers) - 1:
                h = self.norms[i](h)
        return h


MODELS = {
    "sage": GraphSAGE,
    "sage_pn": lambda cfg: GraphSAGE(cfg, pair_norm="PN"),
    "sage_pn_si": lambda cfg: GraphSAGE(cfg, pair_norm="PN-SI"),
}


@torch.no_grad()
def evaluate(model, sampler, feats, labels, idx, args):
    model.eval()
    correct, loss_sum = 0, 0.0
    for i in range(0, len(idx), args.eval_batch_size):
        seeds = idx[i:i + args.eval_batch_size].numpy()
        input_nodes, blocks = sampler.sample(seeds)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            logits = model(feats[torch.from_numpy(input_nodes)], blocks)
        logits = logits.float()
        y = labels[torch.from_numpy(seeds)]
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(idx), loss_sum / len(idx)


def train(model, sampler, feats, labels, split, args):
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)  # expect: AMP010
    best_val, best_state = 0.0, None
    train_idx = split["train"]
    for epoch in range(args.epochs):
        tic = time.time()
        perm = train_idx[torch.randperm(len(train_idx))]
        total_loss, n_batches = 0.0, 0
        for i in range(0, len(perm), args.batch_size):
            seeds = perm[i:i + args.batch_size].numpy()
            input_nodes, blocks = sampler.sample(seeds)
            x = feats[torch.from_numpy(input_nodes)]
            y = labels[torch.from_numpy(seeds)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                logits = model(x, blocks)
                loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total_loss += loss.item()
            n_batches += 1
        val_acc, val_loss = evaluate(model, sampler, feats, labels, split["val"], args)
        if val_acc > best_val:
            best_val = val_acc
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        print(f"epoch {epoch:03d} loss {total_loss / max(n_batches, 1):.4f} val acc {val_acc:.4f} "
              f"val loss {val_loss:.4f} ({time.time() - tic:.1f}s)")
    model.load_state_dict(best_state)
    return best_val


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--graph", default="ogbn-products.npz")
    parser.add_argument("--model", default="sage", choices=list(MODELS))
    parser.add_argument("--aggregator", default="mean", choices=["mean", "gcn", "pool", "attn"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--fanouts", default="15,10,5")
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--eval_batch_size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()

    indptr, indices, feats, labels, split = load_graph(args.graph)
    cfg = dict(in_dim=feats.shape[1], hidden=args.hidden, num_layers=args.num_layers,
               num_classes=int(labels.max()) + 1, aggregator=args.aggregator, dropout=args.dropout)
    model = MODELS[args.model](cfg)
    sampler = NeighborSampler(indptr, indices, [int(f) for f in args.fanouts.split(",")])
    best_val = train(model, sampler, feats, labels, split, args)
    test_acc, _ = evaluate(model, sampler, feats, labels, split["test"], args)
    print(f"best val {best_val:.4f} test {test_acc:.4f}")


if __name__ == "__main__":
    main()
