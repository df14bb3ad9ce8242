"""DCN-V2 (mixture of low-rank cross experts) for click-through and dwell-time
prediction on tabular logs, trained on CPU with bfloat16 autocast."""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

CARDINALITIES = [1000, 500, 200, 50, 24, 7, 10000, 3000]
NUM_DENSE = 13


class FieldEmbedding(nn.Module):
    def __init__(self, cardinalities, dim):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(c + 1, dim, padding_idx=0) for c in cardinalities)
        for table in self.tables:
            nn.init.normal_(table.weight[1:], std=1e-2)

    def forward(self, sparse):
        return torch.cat([t(sparse[:, i]) for i, t in enumerate(self.tables)], dim=1)


class LowRankExpert(nn.Module):
    """U (tanh(C tanh(V x))): one low-rank cross expert of DCN-Mix."""

    def __init__(self, d, rank):
        super().__init__()
        self.V = nn.Linear(d, rank, bias=False)
        self.C = nn.Linear(rank, rank, bias=False)
        self.U = nn.Linear(rank, d)

    def forward(self, xl):
        return self.U(torch.tanh(self.C(torch.tanh(self.V(xl)))))


class CrossLayerMix(nn.Module):
    def __init__(self, d, rank, num_experts):
        super().__init__()
        self.experts = nn.ModuleList(LowRankExpert(d, rank) for _ in range(num_experts))
        self.gate = nn.Linear(d, num_experts, bias=False)

    def forward(self, x0, xl):
        expert_out = torch.stack([x0 * expert(xl) for expert in self.experts], dim=1)
        weights = torch.softmax(self.gate(xl), dim=-1).unsqueeze(-1)
        return (expert_out * weights).sum(dim=1) + xl  # expect: AMP004


class CrossNetMix(nn.Module):
    def __init__(self, d, rank, num_experts, num_layers, eps=1e-5):
        super().__init__()
        self.layers = nn.ModuleList(CrossLayerMix(d, rank, num_experts) for _ in range(num_layers))
        self.eps = eps

    def forward(self, x0):
        xl = x0
        for layer in self.layers:
            xl = layer(x0, xl)
            # parameter-free normalisation between cross layers keeps x0 * xl bounded
            mu = xl.mean(dim=-1, keepdim=True)  # expect: AMP004
            var = xl.var(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
            xl = (xl - mu) * torch.rsqrt(var + self.eps)
        return xl


class DeepTower(nn.Module):
    def __init__(self, d, hidden=(512, 256), dropout=0.1):
        super().__init__()
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        self.net = nn.Sequential(*layers)
        self.out_dim = d

    def forward(self, x):
        return self.net(x)


class DCNv2(nn.Module):
    def __init__(self, cardinalities, num_dense, emb_dim=16, d=256, rank=64, experts=4, cross_layers=3):
        super().__init__()
        self.embed = FieldEmbedding(cardinalities, emb_dim)
        self.dense_norm = nn.BatchNorm1d(num_dense)
        self.stem = nn.Linear(emb_dim * len(cardinalities) + num_dense, d)
        self.cross = CrossNetMix(d, rank, experts, cross_layers)
        self.deep = DeepTower(d)
        self.ctr_head = nn.Linear(d + self.deep.out_dim, 1)
        self.dwell_head = nn.Linear(d + self.deep.out_dim, 1)

    def forward(self, sparse, dense):
        x0 = self.stem(torch.cat([self.embed(sparse), self.dense_norm(dense)], dim=1))
        h = torch.cat([self.cross(x0), self.deep(x0)], dim=1)
        prob = torch.sigmoid(self.ctr_head(h)).squeeze(1)
        dwell = self.dwell_head(h).squeeze(1)
        return prob, dwell


def make_synthetic(n, cardinalities, num_dense, seed=0):
    g = torch.Generator().manual_seed(seed)
    sparse = torch.stack([torch.randint(1, c + 1, (n,), generator=g) for c in cardinalities], dim=1)
    dense = torch.randn(n, num_dense, generator=g).abs().log1p()
    logit = dense[:, 0] - dense[:, 1] + 0.5 * torch.sin(sparse[:, 0].float())
    click = torch.bernoulli(torch.sigmoid(logit), generator=g)
    dwell = click * torch.empty(n).exponential_(0.05, generator=g)
    return TensorDataset(sparse, dense, click, dwell)


def roc_auc(labels, scores):
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    probs, labels, losses = [], [], []
    for sparse, dense, click, _ in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p, _ = model(sparse, dense)
        p = p.float().clamp(1e-7, 1 - 1e-7)
        losses.append(-(click * torch.log(p) + (1 - click) * torch.log(1 - p)).mean().item())
        probs.append(p.numpy())
        labels.append(click.numpy())
    model.train()
    return roc_auc(np.concatenate(labels), np.concatenate(probs)), float(np.mean(losses))


def train(args):
    torch.manual_seed(args.seed)
    train_ds = make_synthetic(args.n_train, CARDINALITIES, NUM_DENSE, seed=args.seed)
    val_ds = make_synthetic(args.n_val, CARDINALITIES, NUM_DENSE, seed=args.seed + 1)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4096)
    model = DCNv2(CARDINALITIES, NUM_DENSE)
    criterion = nn.BCELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")  # expect: AMP010
    for epoch in range(args.epochs):
        model.train()
        total, seen, t0 = 0.0, 0, time.time()
        for sparse, dense, click, dwell in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                prob, dwell_pred = model(sparse, dense)
                ctr_loss = criterion(prob, click)  # expect: AMP003
            dwell_loss = F.smooth_l1_loss(dwell_pred, torch.log1p(dwell))  # expect: AMP002
            loss = ctr_loss + args.dwell_weight * dwell_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total += loss.item() * click.size(0)
            seen += click.size(0)
        auc, logloss = evaluate(model, val_loader)
        print(f"epoch {epoch}: train {total / seen:.4f} val auc {auc:.4f} logloss {logloss:.4f} ({time.time() - t0:.1f}s)")
    return model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n-train", type=int, default=200_000)
    p.add_argument("--n-val", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dwell-weight", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    train(parse_args())
