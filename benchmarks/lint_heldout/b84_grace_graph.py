"""GRACE-style graph contrastive pretraining on dense, padded molecule/protein graphs."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from graphs.dense import DenseGraphDataset, pad_collate


class DenseGATLayer(nn.Module):
    def __init__(self, d_in, d_out, heads=4, dropout=0.1):
        super().__init__()
        self.heads, self.d_head = heads, d_out // heads
        self.W = nn.Linear(d_in, d_out, bias=False)
        self.a_src = nn.Linear(self.d_head, 1, bias=False)
        self.a_dst = nn.Linear(self.d_head, 1, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h, adj):
        B, N, _ = h.shape
        wh = self.W(h).view(B, N, self.heads, self.d_head).transpose(1, 2)  # B, H, N, Dh
        e = self.a_src(wh) + self.a_dst(wh).transpose(-1, -2)  # B, H, N, N
        e = F.leaky_relu(e, 0.2)
        e = e.masked_fill(adj.unsqueeze(1) == 0, torch.finfo(e.dtype).min)
        alpha = self.dropout(torch.softmax(e, dim=-1))
        out = torch.matmul(alpha, wh).transpose(1, 2).reshape(B, N, -1)
        return self.out_proj(out)


class GraphNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, h):
        mean = h.mean(dim=1, keepdim=True)  # expect: AMP004
        centered = h - mean
        std = centered.std(dim=1, keepdim=True)  # expect: AMP004
        return self.weight * centered / (std + 1e-12) + self.bias  # expect: AMP011


class GraphEncoder(nn.Module):
    def __init__(self, d_in, hidden=256, layers=3):
        super().__init__()
        dims = [d_in] + [hidden] * layers
        self.layers = nn.ModuleList([DenseGATLayer(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.norms = nn.ModuleList([GraphNorm(hidden) for _ in range(layers)])

    def forward(self, x, adj):
        h = x
        for layer, norm in zip(self.layers, self.norms):
            h = F.elu(norm(layer(h, adj)))
        return h


class GRACE(nn.Module):
    def __init__(self, d_in, hidden=256, proj=128):
        super().__init__()
        self.encoder = GraphEncoder(d_in, hidden)
        self.projector = nn.Sequential(nn.Linear(hidden, proj), nn.ELU(), nn.Linear(proj, proj))

    def forward(self, x, adj, node_mask):
        z = self.projector(self.encoder(x, adj))
        return z[node_mask]


def augment(x, adj, node_mask, p_edge, p_feat):
    keep = (torch.rand_like(adj, dtype=torch.float32) > p_edge).to(adj.dtype)
    keep = torch.triu(keep, 1)
    adj = adj * (keep + keep.transpose(1, 2))
    adj = adj + torch.eye(adj.shape[-1], device=adj.device) * node_mask.unsqueeze(-1).to(adj.dtype)
    feat_mask = torch.rand(x.shape[-1], device=x.device) < p_feat
    return x.masked_fill(feat_mask, 0.0), adj


def nt_xent(z1, z2, tau):
    z1, z2 = F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)
    z = torch.cat([z1, z2], dim=0)
    n = z1.shape[0]
    sim = z @ z.t() / tau
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(self_mask, -9e15)  # expect: AMP007
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def pretrain(model, loader, args):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for x, adj, node_mask, _ in loader:
            x, adj, node_mask = x.cuda(), adj.cuda(), node_mask.cuda()
            x1, a1 = augment(x, adj, node_mask, args.drop_edge_1, args.drop_feat_1)
            x2, a2 = augment(x, adj, node_mask, args.drop_edge_2, args.drop_feat_2)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nt_xent(model(x1, a1, node_mask), model(x2, a2, node_mask), args.tau)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), args.clip_value)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            total += loss.item()
        print(f"pretrain epoch {epoch}: {total / len(loader):.4f}")


def graph_embeddings(model, loader):
    model.eval()
    feats, labels = [], []
    with torch.no_grad():
        for x, adj, node_mask, y in loader:
            x, adj, node_mask = x.cuda(), adj.cuda(), node_mask.cuda()
            h = model.encoder(x, adj).float()
            m = node_mask.unsqueeze(-1).float()
            feats.append((h * m).sum(1) / m.sum(1).clamp(min=1.0))
            labels.append(y.cuda())
    return torch.cat(feats), torch.cat(labels)


def linear_probe(model, train_loader, test_loader, n_classes, epochs=300):
    emb_tr, y_tr = graph_embeddings(model, train_loader)
    emb_te, y_te = graph_embeddings(model, test_loader)
    clf = nn.Linear(emb_tr.shape[1], n_classes).cuda()
    opt = torch.optim.Adam(clf.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(epochs):
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            loss = F.cross_entropy(clf(emb_tr), y_tr)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (clf(emb_te).argmax(1) == y_te).float().mean().item()
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="PROTEINS")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--tau", type=float, default=0.5)
    ap.add_argument("--clip-value", type=float, default=1.0)
    ap.add_argument("--drop-edge-1", type=float, default=0.2)
    ap.add_argument("--drop-edge-2", type=float, default=0.4)
    ap.add_argument("--drop-feat-1", type=float, default=0.3)
    ap.add_argument("--drop-feat-2", type=float, default=0.4)
    args = ap.parse_args()

    train_set, test_set = DenseGraphDataset(args.dataset, "train"), DenseGraphDataset(args.dataset, "test")
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True, collate_fn=pad_collate)
    eval_loader = DataLoader(train_set, batch_size=256, collate_fn=pad_collate)
    test_loader = DataLoader(test_set, batch_size=256, collate_fn=pad_collate)
    model = GRACE(train_set.num_features).cuda()
    pretrain(model, train_loader, args)
    acc = linear_probe(model, eval_loader, test_loader, train_set.num_classes)
    print(f"linear probe accuracy: {acc:.4f}")


if __name__ == "__main__":
    main()
