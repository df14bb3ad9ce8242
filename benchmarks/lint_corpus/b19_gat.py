"""Graph attention network (GATv2, edge softmax via scatter) for link prediction, CPU bfloat16 autocast."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def add_self_loops(edge_index, num_nodes):
    loops = torch.arange(num_nodes, device=edge_index.device)
    keep = edge_index[0] != edge_index[1]
    return torch.cat([edge_index[:, keep], torch.stack([loops, loops])], dim=1)


def edge_softmax(scores, index, num_nodes):
    """Softmax of edge scores (E, H) over the edges that share a destination node."""
    H = scores.shape[1]
    node_max = torch.full((num_nodes, H), float("-inf"), dtype=scores.dtype, device=scores.device)
    node_max = node_max.scatter_reduce(0, index[:, None].expand(-1, H), scores, reduce="amax", include_self=True)
    exp = (scores - node_max[index]).exp()
    denom = torch.zeros((num_nodes, H), dtype=scores.dtype, device=scores.device).index_add_(0, index, exp)
    return exp / (denom[index] + 1e-16)


class GATv2Conv(nn.Module):
    def __init__(self, in_dim, out_dim, heads=4, dropout=0.2, negative_slope=0.2):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.dropout, self.negative_slope = dropout, negative_slope
        self.lin_src = nn.Linear(in_dim, heads * out_dim)
        self.lin_dst = nn.Linear(in_dim, heads * out_dim)
        self.att = nn.Linear(out_dim, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(heads * out_dim))
        nn.init.xavier_uniform_(self.lin_src.weight)
        nn.init.xavier_uniform_(self.lin_dst.weight)

    def forward(self, x, edge_index):
        N = x.shape[0]
        src, dst = edge_index
        x_src = self.lin_src(x).view(N, self.heads, self.out_dim)
        x_dst = self.lin_dst(x).view(N, self.heads, self.out_dim)
        e = F.leaky_relu(x_src[src] + x_dst[dst], self.negative_slope)
        scores = self.att(e).squeeze(-1)
        alpha = edge_softmax(scores, dst, N)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        msg = x_src[src] * alpha.unsqueeze(-1)
        out = torch.zeros((N, self.heads, self.out_dim), dtype=msg.dtype, device=x.device)
        out = out.index_add_(0, dst, msg)
        return out.reshape(N, self.heads * self.out_dim) + self.bias


class DropEdge(nn.Module):
    """Randomly removes message-passing edges during training."""

    def __init__(self, p=0.2):
        super().__init__()
        self.p = p

    def forward(self, edge_index):
        if not self.training or self.p == 0.0:
            return edge_index
        keep = torch.rand(edge_index.shape[1], device=edge_index.device) >= self.p
        return edge_index[:, keep]


class DegreeEncoder(nn.Module):
    """Adds a learned embedding of the clipped in-degree to the projected node features."""

    def __init__(self, dim, max_degree=64):
        super().__init__()
        self.max_degree = max_degree
        self.emb = nn.Embedding(max_degree + 1, dim)

    def forward(self, h, edge_index):
        deg = torch.bincount(edge_index[1], minlength=h.shape[0]).clamp(max=self.max_degree)
        return h + self.emb(deg)


class GATEncoder(nn.Module):
    def __init__(self, in_dim, hidden=64, out_dim=128, heads=4, layers=3, dropout=0.2, drop_edge=0.2):
        super().__init__()
        self.dropout = dropout
        width = hidden * heads
        self.input_proj = nn.Linear(in_dim, width)
        self.degree = DegreeEncoder(width)
        self.drop_edge = DropEdge(drop_edge)
        self.convs = nn.ModuleList([GATv2Conv(width, hidden, heads, dropout) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(layers)])
        self.out = nn.Linear(width, out_dim)
        self.out_norm = nn.LayerNorm(out_dim)

    def forward(self, x, edge_index):
        h = self.degree(self.input_proj(x), edge_index)
        edge_index = self.drop_edge(edge_index)
        for conv, norm in zip(self.convs, self.norms):
            h = h + F.elu(conv(norm(h), edge_index))
            h = F.dropout(h, self.dropout, self.training)
        return self.out_norm(self.out(h))


class DotProductDecoder(nn.Module):
    def forward(self, z, edge_index):
        src, dst = edge_index
        return (z[src] * z[dst]).sum(dim=-1)  # expect: AMP004


def split_edges(edge_index, val_ratio=0.05, test_ratio=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    src, dst = edge_index
    undirected = edge_index[:, src < dst]
    perm = torch.randperm(undirected.shape[1], generator=g)
    n_val = int(math.floor(val_ratio * perm.numel()))
    n_test = int(math.floor(test_ratio * perm.numel()))
    val = undirected[:, perm[:n_val]]
    test = undirected[:, perm[n_val:n_val + n_test]]
    train = undirected[:, perm[n_val + n_test:]]
    train = torch.cat([train, train.flip(0)], dim=1)
    return train, val, test


def negative_sampling(num_nodes, num_neg, generator=None):
    src = torch.randint(0, num_nodes, (num_neg,), generator=generator)
    dst = torch.randint(0, num_nodes, (num_neg,), generator=generator)
    return torch.stack([src, dst])


def roc_auc(pos, neg):
    scores = torch.cat([pos, neg]).float()
    labels = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)]).float()
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=scores.dtype)
    n_pos, n_neg = labels.sum(), (1 - labels).sum()
    return ((ranks * labels).sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


@torch.no_grad()
def evaluate(encoder, decoder, x, message_edges, pos_edges, seed=1):
    encoder.eval()
    z = encoder(x, message_edges)
    gen = torch.Generator().manual_seed(seed)
    neg_edges = negative_sampling(x.shape[0], pos_edges.shape[1], gen)
    auc = roc_auc(decoder(z, pos_edges), decoder(z, neg_edges))
    encoder.train()
    return float(auc)


def load_features(data):
    x = data["x"].float()
    return (x - x.mean(dim=0)) / (x.std(dim=0) + 1e-8)


def train_link_prediction(data, epochs=300, lr=5e-3, weight_decay=5e-4, center_weight=1e-3, patience=30):
    x = load_features(data)
    num_nodes = x.shape[0]
    train_edges, val_edges, test_edges = split_edges(data["edge_index"])
    message_edges = add_self_loops(train_edges, num_nodes)
    encoder = GATEncoder(x.shape[1])
    decoder = DotProductDecoder()
    optimizer = torch.optim.Adam(encoder.parameters(), lr=lr, weight_decay=weight_decay)
    scaler = torch.amp.GradScaler("cpu")  # expect: AMP010
    best_auc, best_state, bad_epochs = 0.0, None, 0
    for epoch in range(epochs):
        encoder.train()
        optimizer.zero_grad(set_to_none=True)
        neg_edges = negative_sampling(num_nodes, train_edges.shape[1])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = encoder(x, message_edges)
            pos_scores = decoder(z, train_edges)
            neg_scores = decoder(z, neg_edges)
            scores = torch.cat([pos_scores, neg_scores])
            labels = torch.cat([torch.ones_like(pos_scores), torch.zeros_like(neg_scores)])
            loss = F.binary_cross_entropy(torch.sigmoid(scores), labels)  # expect: AMP003
            center_reg = z.mean(dim=0).pow(2).sum()  # expect: AMP004
            loss = loss + center_weight * center_reg
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        val_auc = evaluate(encoder, decoder, x, message_edges, val_edges)
        if val_auc > best_auc:
            best_auc, bad_epochs = val_auc, 0
            best_state = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
        else:
            bad_epochs += 1
            if bad_epochs >= patience:
                break
        if epoch % 20 == 0:
            print(f"epoch {epoch:4d} loss {loss.item():.4f} val_auc {val_auc:.4f}")
    if best_state is not None:
        encoder.load_state_dict(best_state)
    test_auc = evaluate(encoder, decoder, x, message_edges, test_edges)
    return encoder, best_auc, test_auc
