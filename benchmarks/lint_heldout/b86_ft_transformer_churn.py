"""FT-Transformer for binary churn prediction on tabular data with missing features.

Numerical features get a per-feature linear tokenizer, categoricals an embedding; missing
cells are dropped from attention instead of imputed.
"""
import argparse
import math

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

NEG_INF = -1e9


class Standardizer:
    def __init__(self, x):
        x = torch.as_tensor(x, dtype=torch.float32)
        self.mean = torch.nanmean(x, dim=0, keepdim=True)
        self.std = torch.sqrt(torch.nanmean((x - self.mean) ** 2, dim=0, keepdim=True)) + 1e-8

    def __call__(self, x):
        x = torch.as_tensor(x, dtype=torch.float32)
        return (x - self.mean) / self.std


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cat_cardinalities, d):
        super().__init__()
        self.num_weight = nn.Parameter(torch.randn(n_num, d) / math.sqrt(d))
        self.num_bias = nn.Parameter(torch.zeros(n_num, d))
        self.cat_emb = nn.ModuleList([nn.Embedding(c + 1, d) for c in cat_cardinalities])
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)

    def forward(self, x_num, x_cat):
        num_tokens = x_num[..., None] * self.num_weight + self.num_bias
        cat_tokens = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], dim=1)
        cls = self.cls.expand(x_num.shape[0], -1, -1)
        return torch.cat([cls, num_tokens, cat_tokens], dim=1)


class SelfAttention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.dropout(scores.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads, dropout)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * d, d))

    def forward(self, x, key_padding_mask):
        x = x + self.attn(self.norm1(x), key_padding_mask)
        return x + self.ffn(self.norm2(x))


class FTTransformer(nn.Module):
    def __init__(self, n_num, cat_cardinalities, d=192, depth=3, heads=8, dropout=0.1):
        super().__init__()
        self.tokenizer = FeatureTokenizer(n_num, cat_cardinalities, d)
        self.blocks = nn.ModuleList([Block(d, heads, dropout) for _ in range(depth)])
        self.pool_proj = nn.Linear(d, d)
        self.head = nn.Sequential(nn.LayerNorm(3 * d), nn.ReLU(), nn.Linear(3 * d, 1))

    def forward(self, x_num, x_cat, present):
        # present: (B, n_num) bool, False where the raw value was NaN
        x_num = torch.nan_to_num(x_num, nan=0.0)
        x = self.tokenizer(x_num, x_cat)
        n_cat = x_cat.shape[1]
        valid = torch.cat([present.new_ones(present.shape[0], 1), present, present.new_ones(present.shape[0], n_cat)], dim=1)
        for block in self.blocks:
            x = block(x, ~valid)
        h = self.pool_proj(x[:, 1:])
        tok_valid = valid[:, 1:]
        n_valid = tok_valid.sum(dim=1, keepdim=True).clamp(min=1)
        h_mean = h.masked_fill(~tok_valid[..., None], 0.0).sum(dim=1) / n_valid
        h_max = h.masked_fill(~tok_valid[..., None], NEG_INF).amax(dim=1)  # expect: AMP007
        logits = self.head(torch.cat([x[:, 0], h_mean, h_max], dim=-1)).squeeze(-1)
        return torch.sigmoid(logits)


class Trainer:
    def __init__(self, model, lr, weight_decay, device, use_amp=True):
        self.device = device
        self.model = model.to(device)
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "tokenizer" in n]
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "tokenizer" not in n]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
        )
        self.criterion = nn.BCELoss()
        self.scaler = torch.amp.GradScaler("cuda", enabled=use_amp)

    def _to_device(self, batch):
        return [t.to(self.device, non_blocking=True) for t in batch]

    def train_epoch(self, loader, max_grad_norm=1.0):
        self.model.train()
        total, count = 0.0, 0
        for batch in loader:
            x_num, x_cat, present, y = self._to_device(batch)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                probs = self.model(x_num, x_cat, present)
                loss = self.criterion(probs, y)  # expect: AMP003
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            self.scaler.step(self.optimizer)  # expect: AMP006
            total += loss.item() * y.size(0)
            count += y.size(0)
        return total / max(count, 1)

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        all_probs, all_y = [], []
        for batch in loader:
            x_num, x_cat, present, y = self._to_device(batch)
            with torch.autocast("cuda", dtype=torch.float16):
                probs = self.model(x_num, x_cat, present)
            all_probs.append(probs.float().cpu())
            all_y.append(y.cpu())
        probs, y = torch.cat(all_probs), torch.cat(all_y)
        bce = F.binary_cross_entropy(probs, y).item()
        return bce, roc_auc_score(y.numpy(), probs.numpy())


def make_loader(df, num_cols, cat_cols, standardizer, batch_size, shuffle):
    raw = df[num_cols].to_numpy(dtype=np.float32)
    present = torch.from_numpy(~np.isnan(raw))
    x_num = standardizer(raw)
    x_cat = torch.as_tensor(df[cat_cols].to_numpy(dtype=np.int64))
    y = torch.as_tensor(df["churn"].to_numpy(dtype=np.float32))
    ds = torch.utils.data.TensorDataset(x_num, x_cat, present, y)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, pin_memory=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-csv", default="data/churn_train.csv")
    parser.add_argument("--valid-csv", default="data/churn_valid.csv")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=1e-5)
    args = parser.parse_args()

    train_df, valid_df = pd.read_csv(args.train_csv), pd.read_csv(args.valid_csv)
    cat_cols = [c for c in train_df.columns if c.startswith("cat_")]
    num_cols = [c for c in train_df.columns if c.startswith("num_")]
    cards = [int(train_df[c].max()) + 1 for c in cat_cols]
    standardizer = Standardizer(train_df[num_cols].to_numpy(dtype=np.float32))
    train_loader = make_loader(train_df, num_cols, cat_cols, standardizer, args.batch_size, True)
    valid_loader = make_loader(valid_df, num_cols, cat_cols, standardizer, 4 * args.batch_size, False)

    trainer = Trainer(FTTransformer(len(num_cols), cards), args.lr, args.weight_decay, torch.device("cuda"))
    best_auc = -1e9
    for epoch in range(args.epochs):
        train_loss = trainer.train_epoch(train_loader)
        val_bce, val_auc = trainer.evaluate(valid_loader)
        if val_auc > best_auc:
            best_auc = val_auc
            torch.save(trainer.model.state_dict(), "ft_transformer_best.pt")
        print(f"epoch {epoch:3d}  train {train_loss:.4f}  val_bce {val_bce:.4f}  val_auc {val_auc:.4f}")


if __name__ == "__main__":
    main()
