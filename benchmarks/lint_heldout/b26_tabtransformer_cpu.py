"""TabTransformer for mixed categorical / numerical tables (Adult, Bank, Higgs-style CSVs),
with a gated column pool and a TabM-style multi-head output. Meant to train on a CPU
box, optionally in bf16 autocast.
"""
import argparse
import contextlib
import copy
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class ColumnEmbedding(nn.Module):
    """One table for all categorical columns (offset per column) plus a shared column id."""

    def __init__(self, cardinalities, dim, shared_dim=8):
        super().__init__()
        offsets = torch.tensor([0] + list(np.cumsum(cardinalities)[:-1]), dtype=torch.long)
        self.register_buffer("offsets", offsets, persistent=False)
        self.embed = nn.Embedding(int(sum(cardinalities)), dim - shared_dim)
        self.column_embed = nn.Parameter(torch.randn(len(cardinalities), shared_dim) * 0.02)

    def forward(self, x_cat):
        tok = self.embed(x_cat + self.offsets)
        col = self.column_embed.unsqueeze(0).expand(x_cat.size(0), -1, -1)
        return torch.cat([tok, col], dim=-1)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads, ff_mult=4, attn_dropout=0.1, ff_dropout=0.1):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, dim * ff_mult * 2), GEGLU(), nn.Dropout(ff_dropout), nn.Linear(dim * ff_mult, dim))
        self.last_attn = None

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        attn = F.softmax(scores, dim=-1, dtype=torch.float32)
        self.last_attn = attn.detach()
        out = torch.matmul(self.attn_drop(attn), v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(out)
        return x + self.ff(self.norm2(x))


class GatedColumnPool(nn.Module):
    """Soft selection of the informative columns, renormalised by the total gate mass."""

    def __init__(self, dim):
        super().__init__()
        self.gate = nn.Linear(dim, 1)
        self.value = nn.Linear(dim, dim)
        self.last_gate = None

    def forward(self, tok):
        g = torch.sigmoid(self.gate(tok))
        v = self.value(tok)
        self.last_gate = g.detach()
        pooled = (g * v).sum(dim=1)  # expect: AMP004
        return pooled / (g.sum(dim=1) + 1e-8)  # expect: AMP004


class TabTransformer(nn.Module):
    def __init__(self, cardinalities, n_num, num_classes, dim=32, depth=6, heads=8, attn_dropout=0.1,
                 ff_dropout=0.1, mlp_hidden=(256, 128), k_heads=8):
        super().__init__()
        self.col_embed = ColumnEmbedding(cardinalities, dim)
        self.blocks = nn.ModuleList([TransformerBlock(dim, heads, 4, attn_dropout, ff_dropout) for _ in range(depth)])
        self.pool = GatedColumnPool(dim)
        self.num_norm = nn.LayerNorm(n_num)
        in_dim = dim * len(cardinalities) + dim + n_num
        layers = []
        for h in mlp_hidden:
            layers += [nn.Linear(in_dim, h), nn.ReLU(), nn.Dropout(ff_dropout)]
            in_dim = h
        self.mlp = nn.Sequential(*layers)
        self.k_heads = k_heads
        self.num_classes = num_classes
        self.head = nn.Linear(in_dim, num_classes * k_heads)

    def forward(self, x_cat, x_num):
        tok = self.col_embed(x_cat)
        for blk in self.blocks:
            tok = blk(tok)
        pooled = self.pool(tok)
        h = self.mlp(torch.cat([tok.flatten(1), pooled, self.num_norm(x_num)], dim=-1))
        logits = self.head(h).view(-1, self.k_heads, self.num_classes)
        # TabM-style: average the k sub-heads
        return logits.mean(dim=1)  # expect: AMP004


def load_table(path, target, cat_cols, num_cols, stats=None):
    df = pd.read_csv(path)
    x_cat = np.stack([df[c].astype("category").cat.codes.to_numpy() + 1 for c in cat_cols], axis=1).astype(np.int64)
    x_num = df[num_cols].to_numpy(dtype=np.float32)
    if stats is None:
        stats = (x_num.mean(axis=0), x_num.std(axis=0))
    # standardise with train statistics; constant columns keep a tiny denominator
    x_num = (x_num - stats[0]) / (stats[1] + 1e-8)
    y = df[target].astype("category").cat.codes.to_numpy().astype(np.int64)
    return torch.from_numpy(x_cat), torch.from_numpy(x_num.astype(np.float32)), torch.from_numpy(y), stats


def fit(model, train_loader, val_loader, args):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    amp_ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    best_state, best_auc, patience = None, -1.0, 0
    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        for x_cat, x_num, y in train_loader:
            with amp_ctx:
                logits = model(x_cat, x_num)
                loss = F.cross_entropy(logits, y, label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.item() * y.size(0)
        gate_mass = model.pool.last_gate.sum(dim=1, dtype=torch.float32).mean().item()
        auc = evaluate_auc(model, val_loader, args)
        print(f"epoch {epoch}: loss {running / len(train_loader.dataset):.4f} val auc {auc:.4f} gate mass {gate_mass:.2f}")
        if auc > best_auc:
            best_auc, best_state, patience = auc, copy.deepcopy(model.state_dict()), 0
        else:
            patience += 1
            if patience >= args.patience:
                break
    model.load_state_dict(best_state)
    return model


@torch.inference_mode()
def evaluate_auc(model, loader, args):
    model.eval()
    scores, labels = [], []
    for x_cat, x_num, y in loader:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x_cat, x_num)
        scores.append(logits.float().softmax(-1)[:, 1].numpy())
        labels.append(y.numpy())
    s, t = np.concatenate(scores), np.concatenate(labels)
    order = np.argsort(s)
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    n_pos = t.sum()
    n_neg = len(t) - n_pos
    return float((ranks[t == 1].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def column_importance(model, loader):
    # average attention each column receives in the first block, fp32 inference
    model.eval()
    totals = None
    with torch.no_grad():
        for x_cat, x_num, _ in loader:
            model(x_cat, x_num)
            attn = model.blocks[0].last_attn
            per_col = attn.mean(dim=(0, 1, 2))
            totals = per_col if totals is None else totals + per_col
    return (totals / totals.sum()).numpy()


def export_for_serving(model, path):
    serving = copy.deepcopy(model).to(torch.bfloat16).eval()
    torch.save(serving.state_dict(), path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_csv", default="data/adult_train.csv")
    parser.add_argument("--val_csv", default="data/adult_val.csv")
    parser.add_argument("--target", default="income")
    parser.add_argument("--cat_cols", default="workclass,education,marital_status,occupation,relationship,race,sex,native_country")
    parser.add_argument("--num_cols", default="age,fnlwgt,education_num,capital_gain,capital_loss,hours_per_week")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=1e-5)
    parser.add_argument("--patience", type=int, default=15)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", default="runs/tabtransformer")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    cat_cols, num_cols = args.cat_cols.split(","), args.num_cols.split(",")
    xc, xn, y, stats = load_table(args.train_csv, args.target, cat_cols, num_cols)
    vxc, vxn, vy, _ = load_table(args.val_csv, args.target, cat_cols, num_cols, stats)
    cardinalities = [int(max(xc[:, i].max(), vxc[:, i].max())) + 1 for i in range(xc.size(1))]
    train_loader = DataLoader(TensorDataset(xc, xn, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(TensorDataset(vxc, vxn, vy), batch_size=1024)

    model = TabTransformer(cardinalities, n_num=len(num_cols), num_classes=int(y.max()) + 1)
    model = fit(model, train_loader, val_loader, args)
    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, "column_importance.npy"), column_importance(model, val_loader))
    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))
    export_for_serving(model, os.path.join(args.out, "model_bf16.pt"))


if __name__ == "__main__":
    main()
