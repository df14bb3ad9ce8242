"""CTR prediction: DLRM-style embedding bags + FM + DIN history attention.

Trained on CPU (Xeon with AMX) under bf16 autocast.  Sparse embedding tables
are updated with SparseAdam, the dense part with Adagrad, as in the DLRM
reference code.
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader

from ctr.data import ClickLogDataset, collate_clicks


class EmbeddingTables(nn.Module):
    def __init__(self, cardinalities, dim):
        super().__init__()
        self.names = list(cardinalities)
        self.tables = nn.ModuleDict(
            {name: nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for name, n in cardinalities.items()}
        )

    def forward(self, sparse):
        # sparse: name -> (indices, offsets); bags are looked up in fp32 even under autocast
        return torch.stack([self.tables[name](*sparse[name]) for name in self.names], dim=1)


def mlp(sizes, final_act=False):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or final_act:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class HistoryAttention(nn.Module):
    """DIN local activation unit over the user's click history."""

    def __init__(self, dim, hidden=64):
        super().__init__()
        self.att = nn.Sequential(nn.Linear(4 * dim, hidden), nn.PReLU(), nn.Linear(hidden, 1))
        self.value = nn.Linear(dim, dim)

    def forward(self, target, hist, hist_mask):
        t = target.unsqueeze(1).expand_as(hist)
        scores = self.att(torch.cat([t, hist, t - hist, t * hist], dim=-1)).squeeze(-1)
        scores = scores.masked_fill(~hist_mask, -1e4)
        weights = scores.softmax(dim=-1)
        values = self.value(hist)
        pooled = (weights.unsqueeze(-1) * values).sum(dim=1)  # expect: AMP004
        avg = values.mean(dim=1)  # expect: AMP004
        return torch.cat([pooled, avg], dim=-1)


class UserTower(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, 256), nn.ReLU(), nn.Linear(256, out_dim))
        self.norm = nn.LayerNorm(out_dim)

    def forward(self, x):
        return self.norm(self.mlp(x))


class DINRanker(nn.Module):
    def __init__(self, cardinalities, num_items, dense_dim=13, dim=32, user_dim=64, top=(512, 256)):
        super().__init__()
        self.embeddings = EmbeddingTables(cardinalities, dim)
        self.item_emb = nn.Embedding(num_items, dim, padding_idx=0, sparse=True)
        self.bottom = mlp([dense_dim, 256, dim], final_act=True)
        self.hist_att = HistoryAttention(dim)
        self.user_tower = UserTower(3 * dim, user_dim)
        n_sparse = len(cardinalities)
        self.top = mlp([user_dim + n_sparse * dim + 1, *top, 1])

    def forward(self, dense, sparse, hist, hist_mask, target_item):
        emb = self.embeddings(sparse)
        # factorisation-machine term over the fp32 embedding bags
        square_of_sum = emb.sum(dim=1).pow(2)
        sum_of_square = emb.pow(2).sum(dim=1)
        fm = 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)
        interest = self.hist_att(self.item_emb(target_item), self.item_emb(hist), hist_mask)
        u = self.user_tower(torch.cat([self.bottom(dense), interest], dim=-1))
        # remove the batch-mean user vector (popularity drift between days)
        u = u - u.mean(dim=0, keepdim=True)  # expect: AMP004
        logit = self.top(torch.cat([u, emb.flatten(1), fm], dim=-1))
        return {"prob": torch.sigmoid(logit).squeeze(-1), "user": u}


def build_model(args):
    with open(args.cardinalities) as f:
        cards = json.load(f)
    return DINRanker(cards, num_items=args.num_items, dim=args.embed_dim)


def split_params(model):
    sparse, dense = [], []
    for name, p in model.named_parameters():
        (sparse if name.startswith(("embeddings.", "item_emb.")) else dense).append(p)
    return sparse, dense


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    preds, labels = [], []
    for batch in loader:
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            out = model(batch["dense"], batch["sparse"], batch["hist"], batch["hist_mask"], batch["target"])
        preds.append(out["prob"].float().numpy())
        labels.append(batch["label"].numpy())
    preds, labels = np.concatenate(preds), np.concatenate(labels)
    logloss = -np.mean(labels * np.log(preds + 1e-8) + (1 - labels) * np.log(1 - preds + 1e-8))
    model.train()
    return roc_auc_score(labels, preds), float(logloss)


def train(args):
    torch.manual_seed(args.seed)
    model = build_model(args)
    sparse_params, dense_params = split_params(model)
    opt_sparse = torch.optim.SparseAdam(sparse_params, lr=args.lr)
    opt_dense = torch.optim.Adagrad(dense_params, lr=args.lr)
    criterion = nn.BCELoss()
    train_loader = DataLoader(ClickLogDataset(args.data, "train"), batch_size=args.batch_size, shuffle=True,
                              collate_fn=collate_clicks, num_workers=args.workers)
    val_loader = DataLoader(ClickLogDataset(args.data, "val"), batch_size=4096, collate_fn=collate_clicks)
    best_auc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            opt_sparse.zero_grad()
            opt_dense.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(batch["dense"], batch["sparse"], batch["hist"], batch["hist_mask"], batch["target"])
                loss = criterion(out["prob"], batch["label"].float())  # expect: AMP003
                loss.backward()  # expect: AMP008
            opt_sparse.step()
            opt_dense.step()
            if step % args.log_every == 0:
                rate = (step + 1) * args.batch_size / (time.time() - t0)
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} ({rate:.0f} samples/s)")
        auc, logloss = evaluate(model, val_loader)
        print(f"epoch {epoch}: val auc {auc:.5f} logloss {logloss:.5f}")
        if auc > best_auc:
            best_auc = auc
            torch.save({"model": model.state_dict(), "epoch": epoch, "auc": auc},
                       os.path.join(args.out_dir, "best.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--cardinalities", required=True)
    p.add_argument("--num-items", type=int, default=1_000_000)
    p.add_argument("--embed-dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/din")
    train(p.parse_args())
