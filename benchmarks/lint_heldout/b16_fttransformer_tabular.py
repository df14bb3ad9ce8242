"""FT-Transformer for tabular classification with optional masked-feature pre-training.

Numerical features get per-feature linear tokens, categorical ones embeddings; a [CLS]
token is prepended. Missing numerical values are excluded from attention as keys.
"""
import argparse
import copy
import json
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

HALF = torch.float16


class TabularDataset(Dataset):
    def __init__(self, path, split, num_cols, cat_cols, target):
        import pandas as pd

        df = pd.read_parquet(os.path.join(path, f"{split}.parquet"))
        x_num = df[num_cols].to_numpy(np.float32)
        self.missing = torch.from_numpy(np.isnan(x_num))
        # match the serving path, which stores features as fp16
        self.x_num = torch.from_numpy(np.nan_to_num(x_num)).half().float()
        self.x_cat = torch.from_numpy(df[cat_cols].to_numpy(np.int64))
        self.y = torch.from_numpy(df[target].to_numpy(np.int64))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x_num[i], self.x_cat[i], self.missing[i], self.y[i]


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cat_cardinalities, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_num + 1, d))
        self.bias = nn.Parameter(torch.empty(n_num, d))
        offsets = torch.tensor([0] + list(cat_cardinalities[:-1])).cumsum(0)
        self.register_buffer("cat_offsets", offsets, persistent=False)
        self.cat_emb = nn.Embedding(sum(cat_cardinalities), d)
        self.cat_bias = nn.Parameter(torch.empty(len(cat_cardinalities), d))
        for p in (self.weight, self.bias, self.cat_bias):
            nn.init.uniform_(p, -1 / math.sqrt(d), 1 / math.sqrt(d))

    def forward(self, x_num, x_cat):
        ones = torch.ones(x_num.size(0), 1, device=x_num.device, dtype=x_num.dtype)
        x_num = torch.cat([ones, x_num], dim=1)
        tokens = self.weight[None] * x_num[:, :, None]
        tokens = torch.cat([tokens[:, :1], tokens[:, 1:] + self.bias[None]], dim=1)
        cat_tokens = self.cat_emb(x_cat + self.cat_offsets[None]) + self.cat_bias[None]
        return torch.cat([tokens, cat_tokens.to(tokens.dtype)], dim=1)


class MultiheadAttention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads = heads
        self.W_q, self.W_k, self.W_v, self.W_out = (nn.Linear(d, d) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x_q, x_kv, key_keep=None):
        b, tq, d = x_q.shape
        q = self.W_q(x_q).view(b, tq, self.heads, -1).transpose(1, 2)
        k = self.W_k(x_kv).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
        v = self.W_v(x_kv).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        if key_keep is not None:
            scores = torch.where(key_keep[:, None, None, :], scores, torch.tensor(-1e9, device=scores.device))  # expect: AMP007
        attn = self.dropout(scores.softmax(dim=-1))
        return self.W_out((attn @ v).transpose(1, 2).reshape(b, tq, d))


class Block(nn.Module):
    def __init__(self, d, heads, ffn_factor=4 / 3, dropout=0.1, prenorm_attn=True):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d) if prenorm_attn else nn.Identity()
        self.attn = MultiheadAttention(d, heads, dropout)
        hidden = int(d * ffn_factor)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, hidden * 2), nn.GLU(), nn.Dropout(dropout), nn.Linear(hidden, d))

    def forward(self, x, key_keep):
        h = self.attn_norm(x)
        x = x + self.attn(h, h, key_keep)
        return x + self.ffn(self.ffn_norm(x))


class FTTransformer(nn.Module):
    def __init__(self, n_num, cat_cardinalities, n_classes, d=192, depth=3, heads=8):
        super().__init__()
        self.n_num = n_num
        self.tokenizer = FeatureTokenizer(n_num, cat_cardinalities, d)
        self.blocks = nn.ModuleList([Block(d, heads, prenorm_attn=i > 0) for i in range(depth)])
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, n_classes))
        self.recon_head = nn.Linear(d, 1)

    def encode(self, x_num, x_cat, missing):
        x = self.tokenizer(x_num, x_cat)
        keep = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        keep[:, 1 : 1 + self.n_num] = ~missing
        for blk in self.blocks:
            x = blk(x, keep)
        return x

    def forward(self, x_num, x_cat, missing):
        return self.head(self.encode(x_num, x_cat, missing)[:, 0])

    def reconstruct(self, x_num, x_cat, missing):
        return self.recon_head(self.encode(x_num, x_cat, missing)[:, 1 : 1 + self.n_num]).squeeze(-1)


def pretrain(model, loader, device, epochs=20, mask_ratio=0.3, lr=1e-4):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    model.train()
    for epoch in range(epochs):
        total = 0.0
        for x_num, x_cat, missing, _ in loader:
            x_num, x_cat, missing = x_num.to(device), x_cat.to(device), missing.to(device)
            corrupt = (torch.rand_like(x_num) < mask_ratio) & ~missing
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                recon = model.reconstruct(x_num.masked_fill(corrupt, 0.0), x_cat, missing | corrupt)
                loss = F.mse_loss(recon[corrupt], x_num[corrupt])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
        print(f"pretrain epoch {epoch} recon {total / len(loader):.4f}")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, n, nll = 0, 0, 0.0
    dtype = next(model.parameters()).dtype
    for x_num, x_cat, missing, y in loader:
        logits = model(x_num.to(device, dtype=dtype), x_cat.to(device), missing.to(device)).float()
        y = y.to(device)
        nll += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
    model.train()
    return correct / n, nll / n


def fit(model, train_loader, val_loader, device, cfg):
    model.half()  # expect: AMP001
    no_wd = [p for n, p in model.named_parameters() if n.endswith(".bias") or "norm" in n or "tokenizer" in n]
    wd = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or "norm" in n or "tokenizer" in n)]
    optimizer = torch.optim.AdamW([{"params": wd, "weight_decay": cfg.weight_decay}, {"params": no_wd, "weight_decay": 0.0}], lr=cfg.lr, eps=1e-8)  # expect: AMP011
    best_acc, best_state, bad_epochs = -1e9, None, 0
    for epoch in range(cfg.epochs):
        model.train()
        for x_num, x_cat, missing, y in train_loader:
            x_num = x_num.to(device, dtype=HALF)  # expect: AMP001
            x_cat, missing, y = x_cat.to(device), missing.to(device), y.to(device)
            logits = model(x_num, x_cat, missing)
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
        acc, nll = evaluate(model, val_loader, device)
        print(f"epoch {epoch} val acc {acc:.4f} nll {nll:.4f}")
        if acc > best_acc:
            best_acc, best_state, bad_epochs = acc, copy.deepcopy(model.state_dict()), 0
        else:
            bad_epochs += 1
            if bad_epochs >= cfg.patience:
                break
    model.load_state_dict(best_state)
    return best_acc


def export_torchscript(model, path, example):
    served = copy.deepcopy(model).half().eval()
    torch.jit.save(torch.jit.trace(served, tuple(t.half() if t.is_floating_point() else t for t in example)), path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--schema", required=True, help="json with num_cols, cat_cols, cardinalities, target, n_classes")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--pretrain-epochs", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--patience", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--out", default="runs/ft_transformer")
    cfg = p.parse_args()
    schema = json.load(open(cfg.schema))
    device = torch.device("cuda")
    ds = lambda split: TabularDataset(cfg.data, split, schema["num_cols"], schema["cat_cols"], schema["target"])
    train_loader = DataLoader(ds("train"), cfg.batch_size, shuffle=True, drop_last=True, num_workers=4)
    val_loader = DataLoader(ds("val"), 4096, num_workers=4)
    model = FTTransformer(len(schema["num_cols"]), schema["cardinalities"], schema["n_classes"]).to(device)
    if cfg.pretrain_epochs:
        pretrain(model, train_loader, device, epochs=cfg.pretrain_epochs)
    best = fit(model, train_loader, val_loader, device, cfg)
    print(f"best val acc {best:.4f}")
    os.makedirs(cfg.out, exist_ok=True)
    x_num, x_cat, missing, _ = next(iter(val_loader))
    export_torchscript(model, os.path.join(cfg.out, "model.pt"), (x_num[:1].to(device), x_cat[:1].to(device), missing[:1].to(device)))


if __name__ == "__main__":
    main()
