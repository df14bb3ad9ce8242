"""Dense multi-head GAT (Velickovic et al., 2018) on the Planetoid citation graphs.

    python gat_planetoid.py --dataset Cora --hidden 8 --heads 8 --epochs 1000 --patience 100
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_geometric.datasets import Planetoid


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, dropout, alpha, concat=True):
        super().__init__()
        self.out_features = out_features
        self.dropout = dropout
        self.concat = concat
        self.W = nn.Parameter(torch.empty(in_features, out_features))
        self.a = nn.Parameter(torch.empty(2 * out_features, 1))
        nn.init.xavier_uniform_(self.W, gain=1.414)
        nn.init.xavier_uniform_(self.a, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, h, adj):
        Wh = torch.mm(h.type_as(self.W), self.W)
        e = self.leakyrelu(Wh @ self.a[: self.out_features] + (Wh @ self.a[self.out_features:]).T)
        e = e.masked_fill(adj == 0, torch.finfo(e.dtype).min)
        attention = F.softmax(e, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = attention @ Wh
        return F.elu(h_prime) if self.concat else h_prime


class GAT(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout=0.6, alpha=0.2, nheads=8):
        super().__init__()
        self.dropout = dropout
        self.attentions = nn.ModuleList(
            [GraphAttentionLayer(nfeat, nhid, dropout, alpha, concat=True) for _ in range(nheads)]
        )
        self.out_att = GraphAttentionLayer(nhid * nheads, nclass, dropout, alpha, concat=False)

    def embed(self, x, adj):
        x = F.dropout(x, self.dropout, training=self.training)
        return torch.cat([att(x, adj) for att in self.attentions], dim=1)

    def forward(self, x, adj):
        x = self.embed(x, adj)
        x = F.dropout(x, self.dropout, training=self.training)
        x = F.elu(self.out_att(x, adj))
        return F.log_softmax(x, dim=1)


def load_graph(root, name, device):
    data = Planetoid(root, name)[0]
    n = data.num_nodes
    adj = torch.zeros(n, n)
    adj[data.edge_index[0], data.edge_index[1]] = 1.0
    adj = adj + torch.eye(n)
    features = data.x / data.x.sum(dim=1, keepdim=True).clamp(min=1.0)
    return (features.to(device), adj.to(device), data.y.to(device),
            data.train_mask.nonzero().view(-1).to(device),
            data.val_mask.nonzero().view(-1).to(device),
            data.test_mask.nonzero().view(-1).to(device))


def accuracy(output, labels):
    preds = output.argmax(dim=1)
    return preds.eq(labels).double().mean().item()


def train_epoch(model, optimizer, features, adj, labels, idx_train, idx_val):
    model.train()
    optimizer.zero_grad()
    output = model(features, adj)
    loss_train = F.nll_loss(output[idx_train].float(), labels[idx_train])
    acc_train = accuracy(output[idx_train], labels[idx_train])
    loss_train.backward()
    optimizer.step()

    model.eval()
    with torch.no_grad():
        output = model(features, adj)
        loss_val = F.nll_loss(output[idx_val].float(), labels[idx_val]).item()
        acc_val = accuracy(output[idx_val], labels[idx_val])
    return loss_train.item(), acc_train, loss_val, acc_val


@torch.no_grad()
def export_embeddings(model, features, adj, path):
    model.eval()
    emb = model.embed(features, adj).half()
    emb = emb / emb.norm(dim=1, keepdim=True).clamp_min(1e-4)
    torch.save(emb.cpu(), path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/planetoid")
    ap.add_argument("--dataset", default="Cora", choices=["Cora", "CiteSeer", "PubMed"])
    ap.add_argument("--hidden", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.6)
    ap.add_argument("--alpha", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--patience", type=int, default=100)
    ap.add_argument("--out", default="runs/gat")
    args = ap.parse_args()

    device = torch.device("cuda")
    features, adj, labels, idx_train, idx_val, idx_test = load_graph(args.root, args.dataset, device)
    model = GAT(features.size(1), args.hidden, int(labels.max()) + 1, args.dropout, args.alpha, args.heads)
    model = model.to(device)
    model = model.half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, eps=1e-8)  # expect: AMP011

    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, f"{args.dataset}.pt")
    best_loss, bad_epochs = 1e9, 0
    t0 = time.time()
    for epoch in range(args.epochs):
        loss_train, acc_train, loss_val, acc_val = train_epoch(
            model, optimizer, features, adj, labels, idx_train, idx_val
        )
        if epoch % 10 == 0:
            print(f"epoch {epoch:4d} loss {loss_train:.4f} acc {acc_train:.3f} "
                  f"val loss {loss_val:.4f} val acc {acc_val:.3f} ({time.time() - t0:.1f}s)")
        if loss_val < best_loss:
            best_loss, bad_epochs = loss_val, 0
            torch.save(model.state_dict(), ckpt)
        else:
            bad_epochs += 1
            if bad_epochs == args.patience:
                break

    model.load_state_dict(torch.load(ckpt))
    model.eval()
    with torch.no_grad():
        output = model(features, adj)
        print(f"test acc {accuracy(output[idx_test], labels[idx_test]):.4f}")
    export_embeddings(model, features, adj, os.path.join(args.out, f"{args.dataset}_emb.pt"))


if __name__ == "__main__":
    main()
