"""Graph WaveNet for traffic speed forecasting (METR-LA / PEMS-BAY style).

Everything in one file, as in the original repo's train.py + model.py + util.py:
data stub and standard scaler, diffusion graph convolution with an adaptive adjacency,
gated dilated TCN, masked MAE loss, training with optional fp16 autocast, test metrics.
"""
import argparse
import copy
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class StandardScaler:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def transform(self, data):
        return (data - self.mean) / self.std

    def inverse_transform(self, data):
        return data * self.std + self.mean


class BatchIterator:
    def __init__(self, xs, ys, batch_size):
        self.batch_size = batch_size
        pad = (batch_size - len(xs) % batch_size) % batch_size
        self.xs = np.concatenate([xs, np.repeat(xs[-1:], pad, axis=0)], axis=0)
        self.ys = np.concatenate([ys, np.repeat(ys[-1:], pad, axis=0)], axis=0)

    def shuffle(self):
        perm = np.random.permutation(len(self.xs))
        self.xs, self.ys = self.xs[perm], self.ys[perm]

    def get_iterator(self):
        for start in range(0, len(self.xs), self.batch_size):
            yield self.xs[start : start + self.batch_size], self.ys[start : start + self.batch_size]


def load_dataset(num_nodes, seq_len, batch_size):
    """Stub: random speeds in [0, 70) mph with a time-of-day channel."""
    data = {}
    for cat, n in (("train", 2000), ("val", 300), ("test", 300)):
        data["x_" + cat] = (np.random.rand(n, seq_len, num_nodes, 2) * 70).astype(np.float32)
        data["y_" + cat] = (np.random.rand(n, seq_len, num_nodes, 2) * 70).astype(np.float32)
    scaler = StandardScaler(mean=data["x_train"][..., 0].mean(), std=data["x_train"][..., 0].std())
    for cat in ("train", "val", "test"):
        data["x_" + cat][..., 0] = scaler.transform(data["x_" + cat][..., 0])
        data[cat + "_loader"] = BatchIterator(data["x_" + cat], data["y_" + cat], batch_size)
    data["scaler"] = scaler
    return data


def asym_adj(adj):
    rowsum = adj.sum(1)
    d_inv = np.power(rowsum, -1.0).flatten()
    d_inv[np.isinf(d_inv)] = 0.0
    return (np.diag(d_inv) @ adj).astype(np.float32)


def load_adj(num_nodes, seed=0):
    rng = np.random.default_rng(seed)
    adj = (rng.random((num_nodes, num_nodes)) < 0.05).astype(np.float32) + np.eye(num_nodes, dtype=np.float32)
    return [asym_adj(adj), asym_adj(adj.T)]


def masked_mae(preds, labels, null_val=np.nan):
    mask = ~torch.isnan(labels) if np.isnan(null_val) else labels != null_val
    mask = mask.float()
    mask /= torch.mean(mask)
    mask = torch.where(torch.isnan(mask), torch.zeros_like(mask), mask)
    loss = torch.abs(preds - labels) * mask
    loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
    return torch.mean(loss)


def masked_mape(preds, labels, null_val=0.0):
    mask = (labels != null_val).float()
    mask /= torch.mean(mask)
    loss = torch.abs(preds - labels) / (torch.abs(labels) + 1e-8) * mask
    return torch.mean(torch.where(torch.isnan(loss), torch.zeros_like(loss), loss))


def masked_rmse(preds, labels, null_val=0.0):
    mask = (labels != null_val).float()
    mask /= torch.mean(mask)
    return torch.sqrt(torch.mean((preds - labels) ** 2 * mask))


def metric(pred, real):
    return masked_mae(pred, real, 0.0).item(), masked_mape(pred, real, 0.0).item(), masked_rmse(pred, real, 0.0).item()


class NConv(nn.Module):
    def forward(self, x, A):
        return torch.einsum("ncvl,vw->ncwl", x, A).contiguous()


class GraphConv(nn.Module):
    """Diffusion convolution over the given supports, followed by a 1x1 conv."""

    def __init__(self, c_in, c_out, dropout, support_len=3, order=2, node_norm=True):
        super().__init__()
        self.nconv = NConv()
        self.mlp = nn.Conv2d((order * support_len + 1) * c_in, c_out, kernel_size=(1, 1))
        self.dropout, self.order, self.node_norm = dropout, order, node_norm

    def forward(self, x, supports):
        out = [x]
        for a in supports:
            x1 = self.nconv(x, a)
            out.append(x1)
            for _ in range(2, self.order + 1):
                x1 = self.nconv(x1, a)
                out.append(x1)
        h = F.dropout(torch.cat(out, dim=1), self.dropout, training=self.training)
        h = self.mlp(h)
        if self.node_norm:
            mean = h.mean(dim=-1, keepdim=True)  # expect: AMP004
            var = h.var(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
            h = (h - mean) / torch.sqrt(var + 1e-10)  # expect: AMP011
        return h


class GraphWaveNet(nn.Module):
    def __init__(self, num_nodes, dropout=0.3, supports=None, in_dim=2, out_dim=12, residual_channels=32,
                 dilation_channels=32, skip_channels=256, end_channels=512, kernel_size=2, blocks=4, layers=2,
                 adj_topk=0):
        super().__init__()
        self.blocks, self.layers, self.adj_topk = blocks, layers, adj_topk
        self.supports = supports or []
        self.start_conv = nn.Conv2d(in_dim, residual_channels, kernel_size=(1, 1))
        self.nodevec1 = nn.Parameter(torch.randn(num_nodes, 10))
        self.nodevec2 = nn.Parameter(torch.randn(10, num_nodes))
        dilations = [2**i for _ in range(blocks) for i in range(layers)]
        n = blocks * layers
        self.filter_convs = nn.ModuleList([nn.Conv2d(residual_channels, dilation_channels, (1, kernel_size), dilation=d) for d in dilations])
        self.gate_convs = nn.ModuleList([nn.Conv2d(residual_channels, dilation_channels, (1, kernel_size), dilation=d) for d in dilations])
        self.skip_convs = nn.ModuleList([nn.Conv2d(dilation_channels, skip_channels, (1, 1)) for _ in range(n)])
        support_len = len(self.supports) + 1
        self.gconv = nn.ModuleList([GraphConv(dilation_channels, residual_channels, dropout, support_len) for _ in range(n)])
        self.end_conv_1 = nn.Conv2d(skip_channels, end_channels, kernel_size=(1, 1))
        self.end_conv_2 = nn.Conv2d(end_channels, out_dim, kernel_size=(1, 1))
        self.receptive_field = 1 + sum((kernel_size - 1) * d for d in dilations)

    def adaptive_adj(self):
        logits = F.relu(torch.mm(self.nodevec1, self.nodevec2))
        if self.adj_topk > 0:
            kth = logits.topk(self.adj_topk, dim=1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -1e9)  # expect: AMP007
        return F.softmax(logits, dim=1)

    def forward(self, inputs):
        in_len = inputs.size(3)
        x = F.pad(inputs, (self.receptive_field - in_len, 0, 0, 0)) if in_len < self.receptive_field else inputs
        x = self.start_conv(x)
        supports = self.supports + [self.adaptive_adj()]
        skip = 0
        for i in range(self.blocks * self.layers):
            residual = x
            x = torch.tanh(self.filter_convs[i](residual)) * torch.sigmoid(self.gate_convs[i](residual))
            s = self.skip_convs[i](x)
            skip = s + (skip[:, :, :, -s.size(3):] if torch.is_tensor(skip) else 0)
            x = self.gconv[i](x, supports)
            x = x + residual[:, :, :, -x.size(3):]
        x = F.relu(self.end_conv_1(F.relu(skip)))
        return self.end_conv_2(x)


@torch.no_grad()
def evaluate(model, loader, scaler, device):
    model.eval()
    maes, mapes, rmses = [], [], []
    for x, y in loader.get_iterator():
        testx = torch.Tensor(x).to(device).transpose(1, 3)
        testy = torch.Tensor(y).to(device).transpose(1, 3)[:, 0:1, :, :]
        output = model(F.pad(testx, (1, 0, 0, 0))).transpose(1, 3)
        predict = scaler.inverse_transform(output.float())
        mae, mape, rmse = metric(predict, testy.transpose(1, 3))
        maes.append(mae)
        mapes.append(mape)
        rmses.append(rmse)
    model.train()
    return float(np.mean(maes)), float(np.mean(mapes)), float(np.mean(rmses))


def train(args):
    device = torch.device(args.device)
    data = load_dataset(args.num_nodes, args.seq_length, args.batch_size)
    scaler = data["scaler"]
    supports = [torch.tensor(a, device=device).half() for a in load_adj(args.num_nodes)]  # expect: AMP001
    model = GraphWaveNet(args.num_nodes, args.dropout, supports=supports, adj_topk=args.adj_topk).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    ctx = torch.autocast(device_type="cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    best_val, best_state, history = float("inf"), None, []
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_loss, t0 = [], time.time()
        data["train_loader"].shuffle()
        for it, (x, y) in enumerate(data["train_loader"].get_iterator()):
            trainx = torch.Tensor(x).to(device).transpose(1, 3)
            real_val = torch.Tensor(y).to(device).transpose(1, 3)[:, 0:1, :, :]
            optimizer.zero_grad(set_to_none=True)
            with ctx:
                output = model(F.pad(trainx, (1, 0, 0, 0))).transpose(1, 3)
                predict = scaler.inverse_transform(output)
            loss = masked_mae(predict, real_val.transpose(1, 3), 0.0)  # expect: AMP002
            loss.backward()
            if args.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            train_loss.append(loss.item())
            if it % args.print_every == 0:
                print(f"epoch {epoch:03d} iter {it:04d} train MAE {train_loss[-1]:.4f}", flush=True)
        val_mae, val_mape, val_rmse = evaluate(model, data["val_loader"], scaler, device)
        history.append(val_mae)
        print(f"epoch {epoch:03d} train {np.mean(train_loss):.4f} val MAE {val_mae:.4f} "
              f"MAPE {val_mape:.4f} RMSE {val_rmse:.4f} ({time.time() - t0:.1f}s)")
        if val_mae < best_val:
            best_val, best_state = val_mae, copy.deepcopy(model.state_dict())
            torch.save(best_state, os.path.join(args.save, f"exp{args.expid}_best_{round(best_val, 2)}.pth"))
    model.load_state_dict(best_state)
    test_mae, test_mape, test_rmse = evaluate(model, data["test_loader"], scaler, device)
    print(f"best epoch {int(np.argmin(history)) + 1}: test MAE {test_mae:.4f} MAPE {test_mape:.4f} RMSE {test_rmse:.4f}")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", type=str, default="cuda:0")
    parser.add_argument("--num-nodes", type=int, default=207)
    parser.add_argument("--seq-length", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--weight-decay", type=float, default=0.0001)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--adj-topk", type=int, default=0)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast for the forward pass")
    parser.add_argument("--print-every", type=int, default=50)
    parser.add_argument("--save", type=str, default="./garage/metr")
    parser.add_argument("--expid", type=int, default=1)
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.save, exist_ok=True)
    torch.manual_seed(42)
    np.random.seed(42)
    train(args)
