"""Link prediction pretraining and graph-classification fine-tuning for our GNN encoder.

The first section is what used to live in ``gnn/amp_utils.py``: one place that builds the
autocast context and the GradScaler for every entry point, so the fallback for the old
torch on the cluster lives in a single function.

Pure PyTorch (no torch_geometric on the training nodes): message passing is written with
``index_add_`` / ``scatter_reduce``.
"""
import argparse
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- amp utils
def make_grad_scaler(enabled=True, init_scale=2.0 ** 16):
    try:
        return torch.amp.GradScaler("cuda", init_scale=init_scale, enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(init_scale=init_scale, enabled=enabled)


def autocast_ctx(cfg):
    if not cfg.amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=torch.float16)


def backward_and_step(loss, optimizer, scaler, max_norm=None, params=None):
    scaler.scale(loss).backward()
    if max_norm is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- layers
class SegmentSoftmax(torch.autograd.Function):
    """Softmax of edge scores over each destination node's incoming edges (fp32 inside)."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, scores, index, num_nodes):
        idx = index.unsqueeze(-1).expand_as(scores)
        seg_max = scores.new_full((num_nodes, scores.size(1)), float("-inf"))
        seg_max = seg_max.scatter_reduce(0, idx, scores, reduce="amax", include_self=True)
        exp = (scores - seg_max[index]).exp()
        denom = torch.zeros_like(seg_max).index_add_(0, index, exp)
        out = exp / (denom[index] + 1e-16)
        ctx.save_for_backward(out, index)
        ctx.num_nodes = num_nodes
        return out

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        out, index = ctx.saved_tensors
        gs = grad_out * out
        seg = torch.zeros(ctx.num_nodes, out.size(1), dtype=out.dtype, device=out.device).index_add_(0, index, gs)
        return gs - out * seg[index], None, None


class GATConv(nn.Module):
    def __init__(self, in_dim, out_dim, heads=4, negative_slope=0.2, dropout=0.1):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.negative_slope, self.dropout = negative_slope, dropout
        self.lin = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_dim))
        self.bias = nn.Parameter(torch.zeros(heads * out_dim))
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)

    def forward(self, x, edge_index):
        N, H, C = x.size(0), self.heads, self.out_dim
        src, dst = edge_index
        h = self.lin(x).view(N, H, C)
        a_src = (h * self.att_src).sum(dim=-1)
        a_dst = (h * self.att_dst).sum(dim=-1)
        e = F.leaky_relu(a_src[src] + a_dst[dst], self.negative_slope)
        alpha = SegmentSoftmax.apply(e, dst, N)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        msg = h[src] * alpha.unsqueeze(-1)
        out = torch.zeros(N, H, C, dtype=msg.dtype, device=msg.device).index_add_(0, dst, msg)
        return out.reshape(N, H * C) + self.bias


class SAGEMaxConv(nn.Module):
    """GraphSAGE with the max-pooling aggregator."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.pool = nn.Linear(in_dim, in_dim)
        self.lin_self = nn.Linear(in_dim, out_dim)
        self.lin_neigh = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, x, edge_index):
        src, dst = edge_index
        msg = F.relu(self.pool(x))[src]
        agg = torch.full((x.size(0), msg.size(1)), -1e9, dtype=msg.dtype, device=msg.device)  # expect: AMP007
        agg = agg.scatter_reduce(0, dst.unsqueeze(-1).expand_as(msg), msg, reduce="amax", include_self=True)
        agg = agg.masked_fill(agg <= -1e8, 0.0)  # nodes without in-edges
        return self.lin_self(x) + self.lin_neigh(agg)


class GraphEncoder(nn.Module):
    def __init__(self, in_dim, hidden, num_layers=2, heads=4, dropout=0.1):
        super().__init__()
        self.encoder = nn.Linear(in_dim, hidden)
        self.convs = nn.ModuleList(
            [GATConv(hidden, hidden // heads, heads=heads, dropout=dropout) for _ in range(num_layers)]
        )
        self.sage = SAGEMaxConv(hidden, hidden)

    def forward(self, x, edge_index):
        h = self.encoder(x)
        h = (h - h.mean(dim=0, keepdim=True)) / (h.std(dim=0, keepdim=True) + 1e-5)  # expect: AMP004
        for conv in self.convs:
            h = F.elu(conv(h, edge_index)) + h
        return self.sage(h, edge_index)


def global_mean_pool(h, batch, num_graphs):
    out = torch.zeros(num_graphs, h.size(-1), dtype=h.dtype, device=h.device).index_add_(0, batch, h)
    counts = torch.bincount(batch, minlength=num_graphs).clamp(min=1)
    return out / counts.unsqueeze(-1)


def negative_sampling(edge_index, num_nodes, num_neg):
    src = torch.randint(0, num_nodes, (num_neg,), device=edge_index.device)
    dst = torch.randint(0, num_nodes, (num_neg,), device=edge_index.device)
    return torch.stack([src, dst])


# --------------------------------------------------------------------------- training
def train_link_pred(model, data, optimizer, scaler, cfg):
    model.train()
    pos = data.train_pos_edge_index
    neg = negative_sampling(pos, data.num_nodes, pos.size(1))
    optimizer.zero_grad(set_to_none=True)
    with autocast_ctx(cfg):
        z = model(data.x, pos)
        pos_logit = torch.einsum("ed,ed->e", z[pos[0]], z[pos[1]])
        neg_logit = torch.einsum("ed,ed->e", z[neg[0]], z[neg[1]])
        pos_loss = -torch.log(torch.sigmoid(pos_logit) + 1e-15).mean()  # expect: AMP011
        neg_loss = -torch.log(1 - torch.sigmoid(neg_logit) + 1e-15).mean()  # expect: AMP011
        loss = pos_loss + neg_loss
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    optimizer.step()  # expect: AMP006
    return loss.item()


def train_link_pred_minibatch(model, loader, optimizer, scaler, cfg):
    """Cluster-GCN style: one subgraph per step."""
    model.train()
    total = 0.0
    for sub in loader:
        pos = sub.edge_index
        neg = negative_sampling(pos, sub.num_nodes, pos.size(1))
        with autocast_ctx(cfg):
            z = model(sub.x, pos)
            logits = torch.cat([(z[pos[0]] * z[pos[1]]).sum(-1), (z[neg[0]] * z[neg[1]]).sum(-1)])
            labels = torch.cat([torch.ones(pos.size(1)), torch.zeros(neg.size(1))]).to(logits.device)
            loss = F.binary_cross_entropy_with_logits(logits, labels)
        backward_and_step(loss, optimizer, scaler, cfg.max_norm, model.parameters())
        total += loss.item()
    return total / max(len(loader), 1)


@torch.no_grad()
def eval_link_pred(model, data, cfg):
    model.eval()
    with autocast_ctx(cfg):
        z = model(data.x, data.train_pos_edge_index)
    z = z.float()
    pos, neg = data.val_pos_edge_index, data.val_neg_edge_index
    scores = torch.cat([(z[pos[0]] * z[pos[1]]).sum(-1), (z[neg[0]] * z[neg[1]]).sum(-1)]).sigmoid()
    # rank-based AUC: fraction of (pos, neg) pairs ordered correctly
    ranks = scores.cpu().argsort().argsort().float() + 1
    n_pos, n_neg = pos.size(1), neg.size(1)
    return ((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


def finetune_graph_classifier(encoder, loader, num_classes, cfg, device):
    """Downstream task: the link-pred encoder + a linear head, trained in bf16."""
    encoder = encoder.to(device, dtype=torch.bfloat16)  # expect: AMP001
    head = nn.Linear(cfg.hidden, num_classes).to(device)
    params = list(encoder.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    for epoch in range(cfg.epochs):
        for batch in loader:
            batch = batch.to(device)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                h = encoder(batch.x, batch.edge_index)
                logits = head(global_mean_pool(h, batch.batch, batch.num_graphs))
                loss = F.cross_entropy(logits, batch.y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return encoder, head


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--max_norm", type=float, default=2.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--compile", action="store_true")
    cfg = p.parse_args()

    from gnn.data import load_citation_graph  # project-local

    data = load_citation_graph("ogbl-citation2").to("cuda")
    model = GraphEncoder(data.num_features, cfg.hidden, cfg.layers).cuda()
    if cfg.compile:
        model = torch.compile(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scaler = make_grad_scaler(enabled=cfg.amp)
    best_auc = -math.inf
    for epoch in range(1, cfg.epochs + 1):
        loss = train_link_pred(model, data, optimizer, scaler, cfg)
        auc = eval_link_pred(model, data, cfg)
        if auc > best_auc:
            best_auc = auc
            torch.save(model.state_dict(), "encoder_best.pt")
        print(f"epoch {epoch:03d} loss {loss:.4f} val_auc {auc:.4f}")


if __name__ == "__main__":
    main()
