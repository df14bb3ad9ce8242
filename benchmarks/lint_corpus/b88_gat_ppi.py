"""Dense GAT on the PPI protein-interaction graphs (multi-label node classification).

Layer follows the original pyGAT formulation; graphs are small enough (< 4k nodes) that the
dense adjacency fits comfortably and avoids scatter-based message passing.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score
from torch_geometric.datasets import PPI
from torch_geometric.loader import DataLoader
from torch_geometric.utils import to_dense_adj


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, dropout, alpha, concat=True):
        super().__init__()
        self.dropout = dropout
        self.out_features = out_features
        self.concat = concat
        self.W = nn.Parameter(torch.empty(in_features, out_features))
        self.a = nn.Parameter(torch.empty(2 * out_features, 1))
        nn.init.xavier_uniform_(self.W, gain=1.414)
        nn.init.xavier_uniform_(self.a, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)

    def _prepare_attentional_mechanism_input(self, Wh):
        Wh1 = torch.matmul(Wh, self.a[: self.out_features, :])
        Wh2 = torch.matmul(Wh, self.a[self.out_features:, :])
        return self.leakyrelu(Wh1 + Wh2.T)

    def forward(self, h, adj):
        Wh = torch.mm(h, self.W)
        e = self._prepare_attentional_mechanism_input(Wh)
        zero_vec = -9e15 * torch.ones_like(e)  # expect: AMP007
        attention = torch.where(adj > 0, e, zero_vec)
        attention = F.softmax(attention, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime


class GAT(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout, alpha, nheads, nout_heads=6):
        super().__init__()
        self.dropout = dropout
        self.layer1 = nn.ModuleList([GraphAttentionLayer(nfeat, nhid, dropout, alpha) for _ in range(nheads)])
        self.layer2 = nn.ModuleList([GraphAttentionLayer(nhid * nheads, nhid, dropout, alpha)
                                     for _ in range(nheads)])
        self.skip = nn.Linear(nfeat, nhid * nheads)
        self.out_att = nn.ModuleList([GraphAttentionLayer(nhid * nheads, nclass, dropout, alpha, concat=False)
                                      for _ in range(nout_heads)])

    def forward(self, x, adj):
        x = F.dropout(x, self.dropout, training=self.training)
        h = torch.cat([att(x, adj) for att in self.layer1], dim=1)
        h = torch.cat([att(h, adj) for att in self.layer2], dim=1) + self.skip(x)
        return sum(att(h, adj) for att in self.out_att) / len(self.out_att)


def dense_adj(data):
    adj = to_dense_adj(data.edge_index, max_num_nodes=data.num_nodes)[0]
    return adj + torch.eye(data.num_nodes, device=adj.device)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ys, preds = [], []
    for data in loader:
        data = data.to(device)
        logits = model(data.x, dense_adj(data))
        ys.append(data.y.cpu())
        preds.append((logits > 0).float().cpu())
    model.train()
    return f1_score(torch.cat(ys).numpy(), torch.cat(preds).numpy(), average="micro")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/PPI")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--nb-heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--patience", type=int, default=100)
    args = parser.parse_args()

    device = torch.device("cuda")
    train_loader = DataLoader(PPI(args.root, split="train"), batch_size=1, shuffle=True)
    val_loader = DataLoader(PPI(args.root, split="val"), batch_size=1)
    test_loader = DataLoader(PPI(args.root, split="test"), batch_size=1)

    model = GAT(nfeat=50, nhid=args.hidden, nclass=121, dropout=args.dropout,
                alpha=args.alpha, nheads=args.nb_heads).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    best_f1, bad_epochs = 0.0, 0
    for epoch in range(1, args.epochs + 1):
        t = time.time()
        total_loss = 0.0
        for data in train_loader:
            data = data.to(device)
            x = data.x.half()  # expect: AMP001
            adj = dense_adj(data)
            optimizer.zero_grad()
            with torch.cuda.amp.autocast():  # expect: AMP009
                logits = model(x, adj)
                loss = F.binary_cross_entropy(torch.sigmoid(logits), data.y)  # expect: AMP003
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            total_loss += loss.item()

        val_f1 = evaluate(model, val_loader, device)
        print(f"Epoch {epoch:04d} loss {total_loss / len(train_loader):.4f} "
              f"val_f1 {val_f1:.4f} time {time.time() - t:.2f}s")
        if val_f1 > best_f1:
            best_f1, bad_epochs = val_f1, 0
            torch.save(model.state_dict(), "gat_ppi_best.pt")
        else:
            bad_epochs += 1
            if bad_epochs == args.patience:
                break

    model.load_state_dict(torch.load("gat_ppi_best.pt"))
    print(f"test micro-F1: {evaluate(model, test_loader, device):.4f}")


if __name__ == "__main__":
    main()
