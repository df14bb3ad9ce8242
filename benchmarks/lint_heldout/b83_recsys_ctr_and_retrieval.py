"""Two-stage recommender: a two-tower retrieval model trained with BPR on
implicit feedback, and a DeepFM ranker trained on click logs.

Data comes from ``build_features.py`` as parquet files of integer ids.
"""
import argparse
import logging

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

logger = logging.getLogger(__name__)


class UserTower(nn.Module):
    """Attention-pooled watch history followed by an MLP."""

    def __init__(self, n_items, dim=64, hidden=256):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, dim, padding_idx=0)
        self.attn = nn.Linear(dim, 1)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, history):
        emb = self.item_emb(history)
        scores = self.attn(emb).squeeze(-1)
        scores = torch.where(history > 0, scores, torch.tensor(-1e9, device=scores.device))  # expect: AMP007
        weights = scores.softmax(dim=-1)
        pooled = (weights.unsqueeze(-1) * emb).sum(dim=1)
        return self.mlp(pooled)


class ItemTower(nn.Module):
    def __init__(self, n_items, n_categories, dim=64, hidden=256):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, dim)
        self.cat_emb = nn.Embedding(n_categories, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, items, categories):
        return self.mlp(torch.cat([self.item_emb(items), self.cat_emb(categories)], dim=-1))


class BPRLoss(nn.Module):
    """Bayesian personalised ranking with L2 on the embeddings of the batch."""

    def __init__(self, l2=1e-4):
        super().__init__()
        self.l2 = l2

    def forward(self, user_emb, pos_emb, neg_emb):
        pos = (user_emb * pos_emb).sum(dim=-1)
        neg = (user_emb * neg_emb).sum(dim=-1)
        ranking = -F.logsigmoid(pos - neg).mean()
        reg = user_emb.pow(2).sum() + pos_emb.pow(2).sum() + neg_emb.pow(2).sum()
        return ranking + self.l2 * reg / user_emb.shape[0]


class DeepFM(nn.Module):
    def __init__(self, field_dims, embed_dim=16, mlp_dims=(400, 400), dropout=0.2):
        super().__init__()
        offsets = np.concatenate([[0], np.cumsum(field_dims)[:-1]])
        self.register_buffer("offsets", torch.as_tensor(offsets, dtype=torch.long))
        n = int(sum(field_dims))
        self.linear = nn.Embedding(n, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Embedding(n, embed_dim)
        layers, in_dim = [], len(field_dims) * embed_dim
        for d in mlp_dims:
            layers += [nn.Linear(in_dim, d), nn.BatchNorm1d(d), nn.ReLU(), nn.Dropout(dropout)]
            in_dim = d
        layers.append(nn.Linear(in_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, fields):
        idx = fields + self.offsets
        emb = self.embedding(idx)
        first_order = self.linear(idx).squeeze(-1).sum(dim=1) + self.bias
        square_of_sum = emb.sum(dim=1).pow(2)
        sum_of_square = emb.pow(2).sum(dim=1)
        fm = 0.5 * (square_of_sum - sum_of_square).sum(dim=1)
        deep = self.mlp(emb.flatten(1)).squeeze(-1)
        return first_order + fm + deep


def train_retrieval(user_tower, item_tower, loader, args, device):
    params = list(user_tower.parameters()) + list(item_tower.parameters())
    optimizer = torch.optim.Adam(params, lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")
    criterion = BPRLoss(l2=args.l2)
    for epoch in range(args.epochs):
        running = 0.0
        for step, (history, pos, pos_cat, neg, neg_cat) in enumerate(loader):
            history, pos, pos_cat = history.to(device), pos.to(device), pos_cat.to(device)
            neg, neg_cat = neg.to(device), neg_cat.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                u = user_tower(history)
                p = item_tower(pos, pos_cat)
                n = item_tower(neg, neg_cat)
            loss = criterion(u, p, n)  # expect: AMP002
            running += loss.item()
            optimizer.zero_grad(set_to_none=True)
            loss = scaler.scale(loss)
            loss.backward()
            optimizer.step()  # expect: AMP006
            if step % 500 == 0:
                logger.info("retrieval epoch %d step %d bpr %.4f", epoch, step, running / (step + 1))


def train_ranker(model, loader, args, device):
    criterion = nn.BCELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-6)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    model.train()
    for epoch in range(args.epochs):
        for step, (fields, clicks) in enumerate(loader):
            fields, clicks = fields.to(device), clicks.to(device).float()
            with torch.autocast("cuda", dtype=torch.float16):
                probs = torch.sigmoid(model(fields))
                loss = criterion(probs, clicks)  # expect: AMP003
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if step % 1000 == 0:
                logger.info("ranker epoch %d step %d logloss %.4f", epoch, step, loss.item())


@torch.no_grad()
def evaluate_ranker(model, loader, device):
    model.eval()
    probs, labels = [], []
    for fields, clicks in loader:
        probs.append(torch.sigmoid(model(fields.to(device))).float().cpu())
        labels.append(clicks.float())
    probs, labels = torch.cat(probs), torch.cat(labels)
    logloss = F.binary_cross_entropy(probs.clamp(1e-7, 1 - 1e-7), labels).item()
    ranked = labels[torch.argsort(probs)]
    n_pos, n_neg = ranked.sum().item(), (1 - ranked).sum().item()
    negatives_below = (1 - ranked).cumsum(0)
    auc = negatives_below[ranked.bool()].sum().item() / max(1.0, n_pos * n_neg)
    model.train()
    return logloss, auc


def load_tensors(path, columns):
    df = pd.read_parquet(path, columns=columns)
    return TensorDataset(*[torch.as_tensor(np.stack(df[c].to_numpy())) for c in columns])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["retrieval", "ranker"], required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid")
    ap.add_argument("--n-items", type=int, default=500_000)
    ap.add_argument("--n-categories", type=int, default=2_000)
    ap.add_argument("--field-dims", type=int, nargs="+", default=[1000, 24, 7, 5000, 300])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--l2", type=float, default=1e-5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")

    if args.stage == "retrieval":
        data = load_tensors(args.train, ["history", "pos", "pos_cat", "neg", "neg_cat"])
        loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=8)
        user_tower = UserTower(args.n_items).to(device)
        item_tower = ItemTower(args.n_items, args.n_categories).to(device)
        train_retrieval(user_tower, item_tower, loader, args, device)
        torch.save({"user": user_tower.state_dict(), "item": item_tower.state_dict()}, "towers.pt")
    else:
        data = load_tensors(args.train, ["fields", "click"])
        loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=8)
        model = DeepFM(args.field_dims).to(device)
        train_ranker(model, loader, args, device)
        if args.valid:
            valid = DataLoader(load_tensors(args.valid, ["fields", "click"]), batch_size=args.batch_size)
            logloss, auc = evaluate_ranker(model, valid, device)
            logger.info("valid logloss %.4f auc %.4f", logloss, auc)
        torch.save(model.state_dict(), "deepfm.pt")


if __name__ == "__main__":
    main()
