"""Patch-based transformer forecaster for multivariate load series.

Channels are handled independently (channel-independence as in PatchTST),
with reversible instance normalisation around the network. After training,
``--adapt-steps`` runs a short adaptation pass on the most recent window.
"""
import argparse
import math
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class SlidingWindows(Dataset):
    def __init__(self, series, context, horizon, stride=1):
        self.series = torch.as_tensor(series, dtype=torch.float32)
        self.context, self.horizon = context, horizon
        self.starts = list(range(0, len(self.series) - context - horizon + 1, stride))

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.series[s:s + self.context]
        y = self.series[s + self.context:s + self.context + self.horizon]
        return x, y


class RevIN(nn.Module):
    def __init__(self, n_channels, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_channels))
        self.bias = nn.Parameter(torch.zeros(n_channels))

    def normalize(self, x):
        x = x.float()
        self.mean = x.mean(dim=1, keepdim=True).detach()
        self.std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        return (x - self.mean) / self.std * self.weight + self.bias

    def denormalize(self, y):
        y = (y.float() - self.bias) / (self.weight + self.eps)
        return y * self.std + self.mean


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, max_patches, dropout):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(max_patches, max_patches, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.causal[:T, :T], -1e9)  # expect: AMP007
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.out(y)


class Block(nn.Module):
    def __init__(self, d_model, n_heads, max_patches, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_patches, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PatchForecaster(nn.Module):
    def __init__(self, n_channels, context, horizon, patch=16, d_model=128, n_heads=8, n_layers=3, dropout=0.1):
        super().__init__()
        self.patch, self.horizon = patch, horizon
        n_patches = context // patch
        self.revin = RevIN(n_channels)
        self.embed = nn.Linear(patch, d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, d_model) * 0.02)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, n_patches, dropout) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(n_patches * d_model, horizon)

    def forward(self, x):
        B, L, C = x.shape
        x = self.revin.normalize(x)
        x = x.permute(0, 2, 1).reshape(B * C, L)
        x = x.unfold(-1, self.patch, self.patch)
        h = self.embed(x) + self.pos
        for block in self.blocks:
            h = block(h)
        y = self.head(self.ln_f(h).flatten(1))
        y = y.view(B, C, self.horizon).permute(0, 2, 1)
        return self.revin.denormalize(y)


@torch.no_grad()
def evaluate(model, loader, device, amp_ctx):
    model.eval()
    se, ae, n = 0.0, 0.0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with amp_ctx:
            pred = model(x)
        err = pred.float() - y
        se += err.pow(2).sum().item()
        ae += err.abs().sum().item()
        n += err.numel()
    model.train()
    return se / n, ae / n


def train(args, model, train_loader, val_loader, device):
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader), pct_start=0.3)
    criterion = nn.HuberLoss(delta=args.huber_delta)
    best = math.inf
    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        for x, y in train_loader:
            x = x.type("torch.cuda.HalfTensor")  # expect: AMP001
            y = y.to(device, non_blocking=True)
            with amp_ctx:
                pred = model(x)
                loss = criterion(pred, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
        mse, mae = evaluate(model, val_loader, device, amp_ctx)
        print(f"epoch {epoch:3d} | val mse {mse:.4f} mae {mae:.4f} | {time.time() - t0:.1f}s")
        if mse < best:
            best = mse
            torch.save(model.state_dict(), args.checkpoint)
    return best


def adapt_recent(model, recent_loader, args, device):
    """A few steps on the latest window so the forecast follows level shifts."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.adapt_lr, momentum=0.9)
    model.train()
    for _, (x, y) in zip(range(args.adapt_steps), recent_loader):
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.l1_loss(model(x), y)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/load.npy")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--horizon", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--huber-delta", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--adapt-steps", type=int, default=0)
    ap.add_argument("--adapt-lr", type=float, default=1e-4)
    ap.add_argument("--checkpoint", default="forecaster.pt")
    args = ap.parse_args()

    series = np.load(args.data).astype(np.float32)
    n_train, n_val = int(0.7 * len(series)), int(0.1 * len(series))
    train_ds = SlidingWindows(series[:n_train], args.context, args.horizon)
    val_ds = SlidingWindows(series[n_train - args.context:n_train + n_val], args.context, args.horizon, stride=args.horizon)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=256)

    device = torch.device("cuda")
    model = PatchForecaster(series.shape[1], args.context, args.horizon).to(device)
    best = train(args, model, train_loader, val_loader, device)
    print(f"best val mse {best:.4f}")
    if args.adapt_steps:
        model.load_state_dict(torch.load(args.checkpoint))
        recent = SlidingWindows(series[-(args.context + args.horizon) * 4:], args.context, args.horizon, stride=args.horizon)
        adapt_recent(model, DataLoader(recent, batch_size=4, shuffle=True), args, device)
        torch.save(model.state_dict(), args.checkpoint.replace(".pt", "_adapted.pt"))


if __name__ == "__main__":
    main()
