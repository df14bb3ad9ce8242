"""Message-passing GNNs without torch_scatter / PyG.

Node classification on OGB-style graphs and link prediction share the same
encoder; aggregation uses ``index_add_`` so it runs anywhere torch does.
"""
import argparse
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from graphbench.datasets import load_node_dataset, negative_sampling, split_edges
from graphbench.metrics import hits_at_k

logger = logging.getLogger(__name__)


def scatter_sum(src, index, dim_size):
    out = src.new_zeros((dim_size,) + tuple(src.shape[1:]))
    return out.index_add_(0, index, src)


def scatter_mean(src, index, dim_size):
    total = scatter_sum(src, index, dim_size)
    count = scatter_sum(torch.ones_like(index, dtype=src.dtype), index, dim_size).clamp(min=1)
    return total / count.view(-1, *([1] * (src.dim() - 1)))


def segment_softmax(scores, index, num_nodes):
    """Softmax of edge scores over the incoming edges of each node."""
    expanded = index.view(-1, *([1] * (scores.dim() - 1))).expand_as(scores)
    seg_max = scores.new_full((num_nodes,) + tuple(scores.shape[1:]), float("-inf"))
    seg_max = seg_max.scatter_reduce(0, expanded, scores, reduce="amax", include_self=True)
    scores = (scores - seg_max[index]).exp()
    denom = scatter_sum(scores, index, num_nodes)
    return scores / (denom[index] + 1e-16)


def gcn_norm(edge_index, num_nodes, add_self_loops=True):
    src, dst = edge_index
    if add_self_loops:
        loop = torch.arange(num_nodes, device=src.device)
        src, dst = torch.cat([src, loop]), torch.cat([dst, loop])
    deg = torch.zeros(num_nodes, device=src.device).index_add_(0, dst, torch.ones(dst.numel(), device=src.device))
    deg_inv_sqrt = deg.pow(-0.5)
    deg_inv_sqrt[deg_inv_sqrt == float("inf")] = 0.0
    return src, dst, deg_inv_sqrt[src] * deg_inv_sqrt[dst]


def to_dense_batch(x, batch, num_graphs):
    counts = torch.bincount(batch, minlength=num_graphs)
    max_nodes = int(counts.max())
    offsets = torch.cumsum(counts, 0) - counts
    pos = torch.arange(batch.numel(), device=x.device) - offsets[batch]
    out = x.new_zeros(num_graphs, max_nodes, x.size(-1))
    out[batch, pos] = x
    mask = torch.zeros(num_graphs, max_nodes, dtype=torch.bool, device=x.device)
    mask[batch, pos] = True
    return out, mask


class GCNConv(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim)

    def forward(self, x, edge_index):
        h = self.lin(x)
        src, dst, norm = gcn_norm(edge_index, x.size(0))
        msg = h[src] * norm.to(h.dtype).unsqueeze(-1)
        return scatter_sum(msg, dst, x.size(0))


class GatedGCNConv(nn.Module):
    """Residual gated graph conv (Bresson & Laurent, 2017)."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.A = nn.Linear(in_dim, out_dim)
        self.B = nn.Linear(in_dim, out_dim)
        self.D = nn.Linear(in_dim, out_dim)
        self.E = nn.Linear(in_dim, out_dim)

    def forward(self, x, edge_index):
        src, dst = edge_index
        gate = torch.sigmoid(self.D(x)[dst] + self.E(x)[src])
        num = scatter_sum(gate * self.B(x)[src], dst, x.size(0))
        den = scatter_sum(gate, dst, x.size(0))
        return self.A(x) + num / (den + 1e-10)  # expect: AMP011


class GATConv(nn.Module):
    def __init__(self, in_dim, out_dim, heads=4, concat=True, negative_slope=0.2, dropout=0.1):
        super().__init__()
        self.heads, self.out_dim, self.concat = heads, out_dim, concat
        self.negative_slope = negative_slope
        self.dropout = dropout
        self.lin = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_dim))
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)

    def forward(self, x, edge_index):
        src, dst = edge_index
        n = x.size(0)
        h = self.lin(x).view(n, self.heads, self.out_dim)
        a_src = (h * self.att_src).sum(dim=-1)
        a_dst = (h * self.att_dst).sum(dim=-1)
        alpha = F.leaky_relu(a_src[src] + a_dst[dst], self.negative_slope)
        alpha = segment_softmax(alpha, dst, n)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        out = scatter_sum(h[src] * alpha.unsqueeze(-1).to(h.dtype), dst, n)
        if self.concat:
            return out.reshape(n, self.heads * self.out_dim)
        return out.mean(dim=1)  # expect: AMP004


class DenseGATLayer(nn.Module):
    """GAT on a dense adjacency matrix, for the small-graph benchmarks."""

    def __init__(self, in_features, out_features, dropout=0.6, alpha=0.2):
        super().__init__()
        self.dropout = dropout
        self.out_features = out_features
        self.W = nn.Parameter(torch.empty(in_features, out_features))
        self.a = nn.Parameter(torch.empty(2 * out_features, 1))
        nn.init.xavier_uniform_(self.W, gain=1.414)
        nn.init.xavier_uniform_(self.a, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, x, adj):
        wh = torch.matmul(x, self.W)
        e1 = torch.matmul(wh, self.a[: self.out_features])
        e2 = torch.matmul(wh, self.a[self.out_features:])
        e = self.leakyrelu(e1 + e2.transpose(-1, -2))
        attention = e.masked_fill(adj == 0, -9e15)  # expect: AMP007
        attention = F.dropout(F.softmax(attention, dim=-1), self.dropout, training=self.training)
        return F.elu(torch.matmul(attention, wh))


class PairNorm(nn.Module):
    def __init__(self, mode="PN", scale=1.0):
        super().__init__()
        assert mode in ("None", "PN", "PN-SI")
        self.mode, self.scale = mode, scale

    def forward(self, x):
        if self.mode == "None":
            return x
        col_mean = x.mean(dim=0)  # expect: AMP004
        x = x - col_mean
        if self.mode == "PN":
            rownorm_mean = (1e-6 + x.pow(2).sum(dim=1).mean()).sqrt()
            return self.scale * x / rownorm_mean
        rownorm_individual = (1e-6 + x.pow(2).sum(dim=1, keepdim=True)).sqrt()
        return self.scale * x / rownorm_individual


class AttentionReadout(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_nn = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1))

    def forward(self, x, batch, num_graphs):
        dense_x, node_mask = to_dense_batch(x, batch, num_graphs)
        scores = self.gate_nn(dense_x).squeeze(-1)
        scores[~node_mask] = -1e9  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights.unsqueeze(1).to(dense_x.dtype), dense_x).squeeze(1)


CONV_LAYERS = {
    "gcn": lambda i, o, cfg: GCNConv(i, o),
    "gated": lambda i, o, cfg: GatedGCNConv(i, o),
    "gat": lambda i, o, cfg: GATConv(i, o // cfg.heads, heads=cfg.heads),
}


class GNNEncoder(nn.Module):
    def __init__(self, cfg, in_dim):
        super().__init__()
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        dim = in_dim
        for _ in range(cfg.num_layers):
            self.convs.append(CONV_LAYERS[cfg.conv](dim, cfg.hidden, cfg))
            self.norms.append(PairNorm(cfg.pairnorm))
            dim = cfg.hidden
        self.dropout = cfg.dropout
        self.jk = cfg.jk

    def forward(self, x, edge_index):
        xs = []
        for conv, norm in zip(self.convs, self.norms):
            h = conv(x, edge_index)
            xs.append(h)
            x = F.dropout(F.relu(norm(h)), p=self.dropout, training=self.training)
        if self.jk == "cat":
            return torch.cat(xs, dim=-1)
        if self.jk == "mean":
            return torch.stack(xs, dim=0).mean(dim=0)  # expect: AMP004
        return x


class NodeClassifier(nn.Module):
    def __init__(self, cfg, in_dim, num_classes):
        super().__init__()
        self.encoder = GNNEncoder(cfg, in_dim)
        out_dim = cfg.hidden * cfg.num_layers if cfg.jk == "cat" else cfg.hidden
        self.classifier = GATConv(out_dim, num_classes, heads=cfg.heads_out, concat=False)

    def forward(self, x, edge_index):
        return self.classifier(self.encoder(x, edge_index), edge_index)


class GraphClassifier(nn.Module):
    def __init__(self, cfg, in_dim, num_classes):
        super().__init__()
        self.encoder = GNNEncoder(cfg, in_dim)
        self.readout = AttentionReadout(cfg.hidden) if cfg.readout == "attention" else None
        self.head = nn.Linear(cfg.hidden, num_classes)

    def forward(self, x, edge_index, batch, num_graphs):
        h = self.encoder(x, edge_index)
        if self.readout is None:
            return self.head(scatter_mean(h, batch, num_graphs))
        return self.head(self.readout(h, batch, num_graphs))


class DotProductDecoder(nn.Module):
    def forward(self, z, edges):
        return (z[edges[0]] * z[edges[1]]).sum(dim=-1)


def train(args):
    device = torch.device("cuda")
    data, num_classes, split = load_node_dataset(args.dataset, root=args.root)
    # papers100M-sized feature matrices only fit on one GPU in half precision
    x = data.x.half().to(device)  # expect: AMP001
    y = data.y.view(-1).to(device)
    edge_index = data.edge_index.to(device)
    train_idx = split["train"].to(device)

    model = NodeClassifier(args, x.size(1), num_classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    else:
        scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    best_val, best_state = 0.0, None
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            out = model(x, edge_index)
            loss = F.cross_entropy(out[train_idx], y[train_idx])
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        if epoch % args.eval_every == 0:
            accs = evaluate(model, x, y, edge_index, split, args)
            if accs["valid"] > best_val:
                best_val = accs["valid"]
                best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            logger.info("epoch %d loss %.4f %s %.1fs", epoch, loss.item(), accs, time.time() - t0)
    return best_val, best_state


@torch.no_grad()
def evaluate(model, x, y, edge_index, split, args):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
        pred = model(x, edge_index).argmax(dim=-1)
    return {k: (pred[idx] == y[idx]).float().mean().item() for k, idx in split.items()}


def train_link_predictor(encoder, decoder, data, optimizer, scaler, args):
    edges = split_edges(data.edge_index, val_ratio=0.05, test_ratio=0.1)
    train_pos = edges["train_pos"].cuda()
    x = data.x.cuda()
    encoder.train()
    total_loss = 0.0
    for perm in torch.randperm(train_pos.size(1), device=x.device).split(args.batch_size):
        pos = train_pos[:, perm]
        neg = negative_sampling(train_pos, num_nodes=x.size(0), num_neg_samples=perm.numel())
        with torch.autocast("cuda", dtype=torch.float16):
            z = encoder(x, train_pos)
            logits = torch.cat([decoder(z, pos), decoder(z, neg)])
            labels = torch.cat([torch.ones(pos.size(1)), torch.zeros(neg.size(1))]).to(logits.device)
            loss = F.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        total_loss += loss.item() * perm.numel()
    return total_loss / train_pos.size(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=["node", "link"], default="node")
    p.add_argument("--dataset", default="ogbn-arxiv")
    p.add_argument("--root", default="data")
    p.add_argument("--conv", choices=sorted(CONV_LAYERS), default="gcn")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--heads-out", type=int, default=1)
    p.add_argument("--pairnorm", default="None")
    p.add_argument("--jk", choices=["last", "cat", "mean"], default="last")
    p.add_argument("--readout", choices=["mean", "attention"], default="mean")
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=2.0)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--amp", action="store_true")
    args = p.parse_args()

    if args.task == "node":
        best_val, best_state = train(args)
        torch.save(best_state, f"{args.dataset}_{args.conv}.pt")
        logger.info("best valid acc %.4f", best_val)
    else:
        data, _, _ = load_node_dataset(args.dataset, root=args.root)
        encoder = GNNEncoder(args, data.x.size(1)).cuda()
        decoder = DotProductDecoder()
        optimizer = torch.optim.Adam(encoder.parameters(), lr=args.lr)
        scaler = torch.amp.GradScaler("cuda")
        for epoch in range(1, args.epochs + 1):
            loss = train_link_predictor(encoder, decoder, data, optimizer, scaler, args)
            logger.info("epoch %d link loss %.4f", epoch, loss)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
