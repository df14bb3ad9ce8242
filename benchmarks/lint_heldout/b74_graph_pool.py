"""Hierarchical graph classification on dense batches: DiffPool and SAGPool variants.

Graphs are padded to the largest graph in the batch: x (B, N, F), adj (B, N, N),
mask (B, N) bool. Evaluated with 10-fold cross validation on TU datasets.
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tu_dense import load_tu_dataset, dense_loader, kfold_indices

logger = logging.getLogger("graphpool")


class DenseGCNConv(nn.Module):
    """Symmetric-normalised GCN layer, aggregation before the linear map."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.lin = nn.Linear(in_channels, out_channels)

    def forward(self, x, adj, mask=None, add_loop=True):
        n = adj.size(-1)
        if add_loop:
            adj = adj.clone()
            idx = torch.arange(n, device=adj.device)
            adj[:, idx, idx] = 1
        deg_inv_sqrt = adj.sum(dim=-1).clamp(min=1).pow(-0.5)
        adj = deg_inv_sqrt.unsqueeze(-1) * adj * deg_inv_sqrt.unsqueeze(-2)
        out = self.lin(torch.matmul(adj, x))
        if mask is not None:
            out = out * mask.unsqueeze(-1).to(out.dtype)
        return out


class PairNorm(nn.Module):
    """PairNorm (Zhao & Akoglu, 2020) against over-smoothing."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        x = x - x.mean(dim=1, keepdim=True)  # expect: AMP004
        rownorm = (1e-6 + x.pow(2).sum(dim=-1, keepdim=True)).sqrt()
        return self.scale * x / rownorm


def make_graph_norm(kind, dim):
    if kind == "pair":
        return PairNorm()
    if kind == "layer":
        return nn.LayerNorm(dim)
    return nn.Identity()


class GNNStack(nn.Module):
    def __init__(self, in_channels, hidden, out_channels, num_layers=3, norm="pair"):
        super().__init__()
        dims = [in_channels] + [hidden] * num_layers
        self.convs = nn.ModuleList([DenseGCNConv(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.norms = nn.ModuleList([make_graph_norm(norm, hidden) for _ in range(num_layers)])
        self.out = nn.Linear(hidden * num_layers, out_channels)

    def forward(self, x, adj, mask=None):
        xs = []
        for conv, norm in zip(self.convs, self.norms):
            x = F.relu(norm(conv(x, adj, mask)))
            xs.append(x)
        return self.out(torch.cat(xs, dim=-1))


def dense_diff_pool(x, adj, s, mask=None, link_mode="frobenius"):
    s = torch.softmax(s, dim=-1)
    if mask is not None:
        m = mask.unsqueeze(-1).float()
        x, s = x * m.to(x.dtype), s * m
    out = torch.matmul(s.transpose(1, 2), x)
    out_adj = torch.matmul(torch.matmul(s.transpose(1, 2), adj), s)
    if link_mode == "frobenius":
        link_loss = torch.norm(adj - torch.matmul(s, s.transpose(1, 2)), p=2) / adj.numel()
    else:
        pred_adj = torch.matmul(s, s.transpose(1, 2)).clamp(max=1.0)
        link_logp = torch.log(pred_adj + 1e-10)  # expect: AMP011
        link_loss = -(adj * link_logp.float()).sum() / adj.numel()
    ent_loss = (-s * torch.log(s + 1e-15)).sum(dim=-1).mean()
    return out, out_adj, link_loss, ent_loss


class DiffPoolNet(nn.Module):
    def __init__(self, in_channels, num_classes, max_nodes, hidden=64, ratio=0.25, norm="pair", link_mode="frobenius"):
        super().__init__()
        n1 = max(1, int(ratio * max_nodes))
        n2 = max(1, int(ratio * n1))
        self.link_mode = link_mode
        self.pool1, self.embed1 = GNNStack(in_channels, hidden, n1, norm=norm), GNNStack(in_channels, hidden, hidden, norm=norm)
        self.pool2, self.embed2 = GNNStack(hidden, hidden, n2, norm=norm), GNNStack(hidden, hidden, hidden, norm=norm)
        self.embed3 = GNNStack(hidden, hidden, hidden, norm=norm)
        self.classifier = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(0.5), nn.Linear(hidden, num_classes))

    def readout(self, x):
        return torch.cat([x.mean(dim=1), x.amax(dim=1)], dim=-1)  # expect: AMP004

    def forward(self, x, adj, mask):
        s = self.pool1(x, adj, mask)
        x = self.embed1(x, adj, mask)
        x, adj, l1, e1 = dense_diff_pool(x, adj, s, mask, self.link_mode)
        s = self.pool2(x, adj)
        x = self.embed2(x, adj)
        x, adj, l2, e2 = dense_diff_pool(x, adj, s, link_mode=self.link_mode)
        x = self.embed3(x, adj)
        return {"logits": self.classifier(self.readout(x)), "aux_loss": l1 + l2 + e1 + e2}


class DenseSAGPool(nn.Module):
    def __init__(self, in_channels, ratio=0.5):
        super().__init__()
        self.ratio = ratio
        self.score_gnn = DenseGCNConv(in_channels, 1)

    def forward(self, x, adj, mask):
        score = self.score_gnn(x, adj).squeeze(-1)
        score = score.masked_fill(~mask, -1e9)  # expect: AMP007
        k = max(1, int(self.ratio * x.size(1)))
        top, perm = score.topk(k, dim=1)
        gate = torch.tanh(top)
        x = torch.gather(x, 1, perm.unsqueeze(-1).expand(-1, -1, x.size(-1))) * gate.unsqueeze(-1)
        adj = torch.gather(adj, 1, perm.unsqueeze(-1).expand(-1, -1, adj.size(-1)))
        adj = torch.gather(adj, 2, perm.unsqueeze(1).expand(-1, k, -1))
        return x, adj, torch.gather(mask, 1, perm)


class SAGPoolNet(nn.Module):
    def __init__(self, in_channels, num_classes, hidden=128, num_levels=3, ratio=0.5):
        super().__init__()
        self.convs = nn.ModuleList([DenseGCNConv(in_channels if i == 0 else hidden, hidden) for i in range(num_levels)])
        self.pools = nn.ModuleList([DenseSAGPool(hidden, ratio) for _ in range(num_levels)])
        self.classifier = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(0.5), nn.Linear(hidden, num_classes))

    def forward(self, x, adj, mask):
        readout = 0
        for conv, pool in zip(self.convs, self.pools):
            x = F.relu(conv(x, adj, mask))
            x, adj, mask = pool(x, adj, mask)
            readout = readout + torch.cat([x.mean(dim=1), x.amax(dim=1)], dim=-1)  # expect: AMP004
        return {"logits": self.classifier(readout), "aux_loss": torch.zeros((), device=x.device)}


def build_model(args, num_features, num_classes, max_nodes):
    if args.model == "diffpool":
        return DiffPoolNet(num_features, num_classes, max_nodes, args.hidden, norm=args.norm, link_mode=args.link_loss)
    return SAGPoolNet(num_features, num_classes, args.hidden, ratio=args.pool_ratio)


def train(model, loader, optimizer, scaler, args, device):
    model.train()
    total = 0.0
    for batch in loader:
        x, adj, mask, y = (t.to(device, non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            out = model(x, adj, mask)
            loss = F.cross_entropy(out["logits"], y) + args.aux_weight * out["aux_loss"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total += loss.item() * y.size(0)
    return total / len(loader.dataset)


@torch.no_grad()
def test(model, loader, args, device):
    model.eval()
    correct = 0
    for batch in loader:
        x, adj, mask, y = (t.to(device) for t in batch)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            pred = model(x, adj, mask)["logits"].argmax(dim=-1)
        correct += int((pred == y).sum())
    return correct / len(loader.dataset)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="PROTEINS")
    parser.add_argument("--model", default="diffpool", choices=["diffpool", "sagpool"])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--norm", default="pair", choices=["pair", "layer", "none"])
    parser.add_argument("--link-loss", default="frobenius", choices=["frobenius", "bce"])
    parser.add_argument("--pool-ratio", type=float, default=0.5)
    parser.add_argument("--aux-weight", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--half-precision", action="store_true", help="keep weights in fp16 to fit larger graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    set_seed(args.seed)
    device = torch.device("cuda")

    dataset, num_features, num_classes, max_nodes = load_tu_dataset(args.dataset)
    accs = []
    for fold, (train_idx, test_idx) in enumerate(kfold_indices(dataset, 10, args.seed)):
        train_loader = dense_loader(dataset, train_idx, args.batch_size, shuffle=True, max_nodes=max_nodes)
        test_loader = dense_loader(dataset, test_idx, args.batch_size, shuffle=False, max_nodes=max_nodes)
        model = build_model(args, num_features, num_classes, max_nodes).to(device)
        if args.half_precision:
            model = model.half()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)  # expect: AMP011
        scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        best = 0.0
        for epoch in range(args.epochs):
            loss = train(model, train_loader, optimizer, scaler, args, device)
            acc = test(model, test_loader, args, device)
            best = max(best, acc)
            if epoch % 20 == 0:
                logger.info("fold %d epoch %d loss %.4f acc %.4f", fold, epoch, loss, acc)
        accs.append(best)
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.out, f"{args.dataset}_{args.model}_fold{fold}.pt"))
    logger.info("%s %s: %.4f +- %.4f", args.dataset, args.model, float(np.mean(accs)), float(np.std(accs)))


if __name__ == "__main__":
    main()
