"""Multivariate long-horizon forecasting with a temporal convolutional network (TCN) and
instance normalisation, trained in half precision to fit long look-back windows.

    python b26_tcn_forecast_fp16.py --data data/ETTh1.csv --seq_len 720 --pred_len 96
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset


class Chomp1d(nn.Module):
    def __init__(self, chomp_size):
        super().__init__()
        self.chomp_size = chomp_size

    def forward(self, x):
        return x[:, :, : -self.chomp_size].contiguous()


class TemporalBlock(nn.Module):
    def __init__(self, n_inputs, n_outputs, kernel_size, dilation, dropout=0.2):
        super().__init__()
        padding = (kernel_size - 1) * dilation
        self.conv1 = weight_norm(nn.Conv1d(n_inputs, n_outputs, kernel_size, padding=padding, dilation=dilation))
        self.conv2 = weight_norm(nn.Conv1d(n_outputs, n_outputs, kernel_size, padding=padding, dilation=dilation))
        self.net = nn.Sequential(
            self.conv1, Chomp1d(padding), nn.ReLU(), nn.Dropout(dropout),
            self.conv2, Chomp1d(padding), nn.ReLU(), nn.Dropout(dropout),
        )
        self.downsample = nn.Conv1d(n_inputs, n_outputs, 1) if n_inputs != n_outputs else None
        self.relu = nn.ReLU()
        self.conv1.weight.data.normal_(0, 0.01)
        self.conv2.weight.data.normal_(0, 0.01)

    def forward(self, x):
        res = x if self.downsample is None else self.downsample(x)
        return self.relu(self.net(x) + res)


class TemporalConvNet(nn.Module):
    def __init__(self, num_inputs, num_channels, kernel_size=3, dropout=0.2):
        super().__init__()
        layers = []
        for i, out_ch in enumerate(num_channels):
            in_ch = num_inputs if i == 0 else num_channels[i - 1]
            layers.append(TemporalBlock(in_ch, out_ch, kernel_size, dilation=2 ** i, dropout=dropout))
        self.network = nn.Sequential(*layers)

    def forward(self, x):
        return self.network(x)


class TCNForecaster(nn.Module):
    def __init__(self, n_vars, pred_len, channels=(64, 64, 64, 64), kernel_size=3, dropout=0.1, scaling="revin"):
        super().__init__()
        self.pred_len = pred_len
        self.scaling = scaling
        self.tcn = TemporalConvNet(n_vars, list(channels), kernel_size, dropout)
        self.head = nn.Linear(channels[-1], n_vars * pred_len)
        self.affine_weight = nn.Parameter(torch.ones(1, 1, n_vars))
        self.affine_bias = nn.Parameter(torch.zeros(1, 1, n_vars))

    def forward(self, x):
        # x: (batch, seq_len, n_vars)
        if self.scaling == "revin":
            loc = x.mean(dim=1, keepdim=True).detach()  # expect: AMP004
            x = x - loc
            scale = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + 1e-5).detach()  # expect: AMP004
            x = x / scale
        else:
            # mean-absolute scaling, as in DeepAR's MeanScaler
            scale = x.abs().mean(dim=1, keepdim=True).detach()  # expect: AMP004
            loc = torch.zeros_like(scale)
            x = x / (scale + 1e-10)  # expect: AMP011
        x = x * self.affine_weight + self.affine_bias
        h = self.tcn(x.transpose(1, 2))
        out = self.head(h[:, :, -1]).view(x.size(0), self.pred_len, -1)
        out = (out - self.affine_bias) / self.affine_weight
        return out * scale + loc


class WindowDataset(Dataset):
    def __init__(self, path, split, seq_len, pred_len, train_frac=0.7, val_frac=0.1):
        df = pd.read_csv(path)
        data = df.drop(columns=["date"]).to_numpy(dtype=np.float32)
        n = len(data)
        n_train, n_val = int(n * train_frac), int(n * val_frac)
        bounds = {"train": (0, n_train), "val": (n_train - seq_len, n_train + n_val), "test": (n_train + n_val - seq_len, n)}
        mean, std = data[:n_train].mean(axis=0), data[:n_train].std(axis=0)
        data = (data - mean) / (std + 1e-8)
        lo, hi = bounds[split]
        self.data = data[lo:hi]
        self.seq_len, self.pred_len = seq_len, pred_len
        self.n_vars = data.shape[1]

    def __len__(self):
        return len(self.data) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        x = self.data[i: i + self.seq_len]
        y = self.data[i + self.seq_len: i + self.seq_len + self.pred_len]
        return torch.from_numpy(x), torch.from_numpy(y)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    mse, mae, n = 0.0, 0.0, 0
    for x, y in loader:
        pred = model(x.to(device).half()).float()
        y = y.to(device)
        mse += F.mse_loss(pred, y, reduction="sum").item()
        mae += (pred - y).abs().sum().item()
        n += y.numel()
    model.train()
    return mse / n, mae / n


def train(args):
    device = torch.device("cuda")
    train_ds = WindowDataset(args.data, "train", args.seq_len, args.pred_len)
    val_ds = WindowDataset(args.data, "val", args.seq_len, args.pred_len)
    test_ds = WindowDataset(args.data, "test", args.seq_len, args.pred_len)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=4)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4)
    test_loader = DataLoader(test_ds, batch_size=args.batch_size, num_workers=4)

    model = TCNForecaster(train_ds.n_vars, args.pred_len, channels=[args.hidden] * args.levels,
                          kernel_size=args.kernel_size, dropout=args.dropout, scaling=args.scaling)
    model = model.to(device).half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    best_val, bad_epochs = 1e9, 0
    ckpt = os.path.join(args.out_dir, "tcn_best.pt")
    for epoch in range(args.epochs):
        model.train()
        losses = []
        for x, y in train_loader:
            x = x.to(device, non_blocking=True).half()  # expect: AMP001
            y = y.to(device, non_blocking=True)
            pred = model(x)
            loss = F.mse_loss(pred.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()
        val_mse, val_mae = evaluate(model, val_loader, device)
        print(f"epoch {epoch} | train {np.mean(losses):.4f} | val mse {val_mse:.4f} mae {val_mae:.4f}")
        if val_mse < best_val:
            best_val, bad_epochs = val_mse, 0
            torch.save(model.state_dict(), ckpt)
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                print("early stopping")
                break

    model.load_state_dict(torch.load(ckpt))
    test_mse, test_mae = evaluate(model, test_loader, device)
    print(f"test mse {test_mse:.4f} mae {test_mae:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/ETTh1.csv")
    parser.add_argument("--out_dir", default="checkpoints/tcn")
    parser.add_argument("--seq_len", type=int, default=720)
    parser.add_argument("--pred_len", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--levels", type=int, default=6)
    parser.add_argument("--kernel_size", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--scaling", choices=["revin", "mean"], default="revin")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--patience", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args)
