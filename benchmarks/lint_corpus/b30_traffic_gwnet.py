"""Graph WaveNet for traffic forecasting (METR-LA / PEMS-BAY).

Dilated gated temporal convolutions interleaved with diffusion graph convolutions
over fixed and self-adaptive adjacency matrices; probabilistic multi-horizon heads.
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class StandardScaler:
    def __init__(self, mean, std):
        self.mean = float(mean)
        self.std = float(std)

    def transform(self, data):
        return (data - self.mean) / self.std

    def inverse_transform(self, data):
        return data * self.std + self.mean


def masked_mae(preds, labels, null_val=np.nan):
    if np.isnan(null_val):
        mask = ~torch.isnan(labels)
    else:
        mask = labels != null_val
    mask = mask.float()
    mask /= torch.mean(mask)
    mask = torch.where(torch.isnan(mask), torch.zeros_like(mask), mask)
    loss = torch.abs(preds - labels)
    loss = loss * mask
    loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
    return torch.mean(loss)


def masked_mape(preds, labels, null_val=np.nan):
    mask = (labels != null_val).float()
    mask /= torch.mean(mask)
    mask = torch.where(torch.isnan(mask), torch.zeros_like(mask), mask)
    loss = torch.abs(preds - labels) / labels
    loss = loss * mask
    loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
    return torch.mean(loss)


def masked_rmse(preds, labels, null_val=np.nan):
    mask = (labels != null_val).float()
    mask /= torch.mean(mask)
    mask = torch.where(torch.isnan(mask), torch.zeros_like(mask), mask)
    loss = (preds - labels) ** 2
    loss = loss * mask
    loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
    return torch.sqrt(torch.mean(loss))


def sym_adj(adj):
    adj = adj + np.eye(adj.shape[0])
    rowsum = adj.sum(1)
    d_inv_sqrt = np.power(rowsum, -0.5)
    d_inv_sqrt[np.isinf(d_inv_sqrt)] = 0.0
    d_mat = np.diag(d_inv_sqrt)
    return d_mat @ adj @ d_mat


def asym_adj(adj):
    rowsum = adj.sum(1)
    d_inv = np.power(rowsum, -1.0)
    d_inv[np.isinf(d_inv)] = 0.0
    return np.diag(d_inv) @ adj


class NConv(nn.Module):
    def forward(self, x, a):
        return torch.einsum("ncvl,vw->ncwl", x, a).contiguous()


class GraphConv(nn.Module):
    def __init__(self, c_in, c_out, dropout, support_len=3, order=2):
        super().__init__()
        self.nconv = NConv()
        self.mlp = nn.Conv2d((order * support_len + 1) * c_in, c_out, kernel_size=1)
        self.dropout = dropout
        self.order = order

    def forward(self, x, supports):
        out = [x]
        for a in supports:
            x1 = self.nconv(x, a)
            out.append(x1)
            for _ in range(2, self.order + 1):
                x2 = self.nconv(x1, a)
                out.append(x2)
                x1 = x2
        h = self.mlp(torch.cat(out, dim=1))
        return F.dropout(h, self.dropout, training=self.training)


class NodeNorm(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=(1, 3), keepdim=True)  # expect: AMP004
        std = x.std(dim=(1, 3), keepdim=True)  # expect: AMP004
        return (x - mean) / (std + self.eps)


class HorizonHead(nn.Module):
    def __init__(self, skip_channels, end_channels, horizon):
        super().__init__()
        self.fc1 = nn.Conv2d(skip_channels, end_channels, kernel_size=1)
        self.loc = nn.Conv2d(end_channels, horizon, kernel_size=1)
        self.scale = nn.Conv2d(end_channels, horizon, kernel_size=1)

    def forward(self, x):
        h = F.relu(self.fc1(F.relu(x)))
        h = h + h.mean(dim=2, keepdim=True)  # expect: AMP004
        loc = self.loc(h)
        scale = torch.abs(self.scale(h)) + 1e-9  # expect: AMP011
        return loc, scale


class GWNet(nn.Module):
    def __init__(self, num_nodes, dropout=0.3, supports=None, in_dim=2, out_dim=12, residual_channels=32,
                 dilation_channels=32, skip_channels=256, end_channels=512, kernel_size=2, blocks=4, layers=2,
                 adj_mask=None):
        super().__init__()
        self.blocks, self.layers = blocks, layers
        self.supports = supports or []
        self.start_conv = nn.Conv2d(in_dim, residual_channels, kernel_size=1)
        self.nodevec1 = nn.Parameter(torch.randn(num_nodes, 10))
        self.nodevec2 = nn.Parameter(torch.randn(10, num_nodes))
        if adj_mask is not None:
            self.register_buffer("adj_mask", adj_mask)
        else:
            self.adj_mask = None
        self.filter_convs = nn.ModuleList()
        self.gate_convs = nn.ModuleList()
        self.skip_convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        self.bn = nn.ModuleList()
        self.gconv = nn.ModuleList()
        receptive_field = 1
        support_len = len(self.supports) + 1
        for _ in range(blocks):
            additional_scope = kernel_size - 1
            dilation = 1
            for _ in range(layers):
                self.filter_convs.append(nn.Conv2d(residual_channels, dilation_channels, (1, kernel_size), dilation=dilation))
                self.gate_convs.append(nn.Conv2d(residual_channels, dilation_channels, (1, kernel_size), dilation=dilation))
                self.skip_convs.append(nn.Conv2d(dilation_channels, skip_channels, kernel_size=1))
                self.norms.append(NodeNorm())
                self.bn.append(nn.BatchNorm2d(residual_channels))
                self.gconv.append(GraphConv(dilation_channels, residual_channels, dropout, support_len=support_len))
                dilation *= 2
                receptive_field += additional_scope
                additional_scope *= 2
        self.receptive_field = receptive_field
        self.heads = nn.ModuleDict({
            "short": HorizonHead(skip_channels, end_channels, 3),
            "long": HorizonHead(skip_channels, end_channels, out_dim - 3),
        })

    def adaptive_adj(self):
        logits = F.relu(torch.mm(self.nodevec1, self.nodevec2))
        if self.adj_mask is not None:
            logits = logits.masked_fill(self.adj_mask == 0, -1e9)  # expect: AMP007
        return F.softmax(logits, dim=1)

    def forward(self, x):
        if x.size(3) < self.receptive_field:
            x = F.pad(x, (self.receptive_field - x.size(3), 0, 0, 0))
        x = self.start_conv(x)
        skip = 0
        supports = list(self.supports) + [self.adaptive_adj()]
        for i in range(self.blocks * self.layers):
            residual = x
            filt = torch.tanh(self.filter_convs[i](residual))
            gate = torch.sigmoid(self.gate_convs[i](residual))
            x = self.norms[i](filt * gate)
            s = self.skip_convs[i](x)
            try:
                skip = skip[:, :, :, -s.size(3):]
            except TypeError:
                skip = 0
            skip = s + skip
            x = self.gconv[i](x, supports)
            x = x + residual[:, :, :, -x.size(3):]
            x = self.bn[i](x)
        locs, scales = [], []
        for _, head in self.heads.items():
            loc, scale = head(skip)
            locs.append(loc)
            scales.append(scale)
        return torch.cat(locs, dim=1), torch.cat(scales, dim=1)


class Engine:
    def __init__(self, scaler, in_dim, seq_length, num_nodes, nhid, dropout, lrate, wdecay, device, supports,
                 adj_mask=None, clip=5.0, nll_weight=0.1):
        self.model = GWNet(num_nodes, dropout, supports=supports, in_dim=in_dim, out_dim=seq_length,
                           residual_channels=nhid, dilation_channels=nhid, skip_channels=nhid * 8,
                           end_channels=nhid * 16, adj_mask=adj_mask)
        self.model.to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lrate, weight_decay=wdecay)
        self.loss = masked_mae
        self.scaler = scaler
        self.clip = clip
        self.device = device
        self.nll_weight = nll_weight

    def train(self, input, real_val):
        self.model.train()
        self.optimizer.zero_grad()
        input = input.to(self.device, dtype=torch.float16)  # expect: AMP001
        input = F.pad(input, (1, 0, 0, 0))
        real = torch.unsqueeze(real_val, dim=1)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            loc, scale = self.model(input)
            loc, scale = loc.transpose(1, 3), scale.transpose(1, 3)
            predict = self.scaler.inverse_transform(loc)
            loss = self.loss(predict, real, 0.0)
            nll = F.gaussian_nll_loss(loc, self.scaler.transform(real), scale.pow(2))
            total = loss + self.nll_weight * nll
        total.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        mape = masked_mape(predict, real, 0.0).item()
        rmse = masked_rmse(predict, real, 0.0).item()
        return loss.item(), mape, rmse

    def eval(self, input, real_val):
        self.model.eval()
        input = F.pad(input.to(self.device), (1, 0, 0, 0))
        real = torch.unsqueeze(real_val, dim=1)
        with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.float16):
            loc, _ = self.model(input)
            predict = self.scaler.inverse_transform(loc.transpose(1, 3))
            loss = self.loss(predict, real, 0.0)
            mape = masked_mape(predict, real, 0.0).item()
            rmse = masked_rmse(predict, real, 0.0).item()
        return loss.item(), mape, rmse


def load_dataset(dataset_dir, batch_size):
    data = {}
    for category in ("train", "val", "test"):
        cat_data = np.load(os.path.join(dataset_dir, category + ".npz"))
        data["x_" + category] = cat_data["x"]
        data["y_" + category] = cat_data["y"]
    scaler = StandardScaler(mean=data["x_train"][..., 0].mean(), std=data["x_train"][..., 0].std())
    for category in ("train", "val", "test"):
        data["x_" + category][..., 0] = scaler.transform(data["x_" + category][..., 0])
    data["scaler"] = scaler
    return data


def iterate(x, y, batch_size, shuffle=False):
    idx = np.random.permutation(len(x)) if shuffle else np.arange(len(x))
    for start in range(0, len(x), batch_size):
        sel = idx[start:start + batch_size]
        yield x[sel], y[sel]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/METR-LA")
    parser.add_argument("--adjdata", default="data/sensor_graph/adj_mx.pkl")
    parser.add_argument("--nhid", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=0.001)
    parser.add_argument("--weight_decay", type=float, default=0.0001)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--mask_adaptive", action="store_true")
    parser.add_argument("--save", default="./garage/metr")
    args = parser.parse_args()
    device = torch.device("cuda")

    with open(args.adjdata, "rb") as f:
        _, _, adj_mx = pickle.load(f, encoding="latin1")
    supports = [torch.tensor(asym_adj(adj_mx), dtype=torch.float32, device=device),
                torch.tensor(asym_adj(np.transpose(adj_mx)), dtype=torch.float32, device=device)]
    adj_mask = None
    if args.mask_adaptive:
        adj_mask = torch.tensor(sym_adj(adj_mx) > 0, device=device)
    data = load_dataset(args.data, args.batch_size)
    scaler = data["scaler"]
    engine = Engine(scaler, 2, 12, adj_mx.shape[0], args.nhid, 0.3, args.learning_rate, args.weight_decay,
                    device, supports, adj_mask=adj_mask)

    best_val_loss = 1e9
    os.makedirs(args.save, exist_ok=True)
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        train_metrics = []
        for x, y in iterate(data["x_train"], data["y_train"], args.batch_size, shuffle=True):
            trainx = torch.Tensor(x).to(device).transpose(1, 3)
            trainy = torch.Tensor(y).to(device).transpose(1, 3)
            train_metrics.append(engine.train(trainx, trainy[:, 0, :, :]))
        val_metrics = []
        for x, y in iterate(data["x_val"], data["y_val"], args.batch_size):
            valx = torch.Tensor(x).to(device).transpose(1, 3)
            valy = torch.Tensor(y).to(device).transpose(1, 3)
            val_metrics.append(engine.eval(valx, valy[:, 0, :, :]))
        tr = np.mean(train_metrics, axis=0)
        va = np.mean(val_metrics, axis=0)
        print(f"epoch {epoch:03d} train mae {tr[0]:.4f} mape {tr[1]:.4f} rmse {tr[2]:.4f} | "
              f"val mae {va[0]:.4f} mape {va[1]:.4f} rmse {va[2]:.4f} | {time.time() - t0:.1f}s")
        if va[0] < best_val_loss:
            best_val_loss = va[0]
            torch.save(engine.model.state_dict(), os.path.join(args.save, "best.pth"))


if __name__ == "__main__":
    main()
