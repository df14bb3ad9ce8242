"""Fourier Neural Operator for 2D incompressible Navier-Stokes.

Two variants: the classic vorticity FNO (predicts w at the next step from the
last `t_in` steps) and a velocity-pressure operator that predicts (u, v, p)
with a zero-mean pressure gauge.
"""
import argparse
import copy
import math
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class UnitGaussianNormalizer(nn.Module):
    def __init__(self, x, eps=1e-5):
        super().__init__()
        self.register_buffer("mean", torch.mean(x, 0))
        self.register_buffer("std", torch.std(x, 0))
        self.eps = eps

    def encode(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def decode(self, x):
        return x * (self.std + self.eps) + self.mean


class SpectralConv2d(nn.Module):
    def __init__(self, in_ch, out_ch, modes1, modes2):
        super().__init__()
        self.out_ch, self.modes1, self.modes2 = out_ch, modes1, modes2
        scale = 1.0 / (in_ch * out_ch)
        self.weights1 = nn.Parameter(scale * torch.rand(in_ch, out_ch, modes1, modes2, dtype=torch.cfloat))
        self.weights2 = nn.Parameter(scale * torch.rand(in_ch, out_ch, modes1, modes2, dtype=torch.cfloat))

    @staticmethod
    def compl_mul2d(a, w):
        return torch.einsum("bixy,ioxy->boxy", a, w)

    def forward(self, x):
        b, _, sx, sy = x.shape
        with torch.autocast(device_type="cuda", enabled=False):
            x_ft = torch.fft.rfft2(x.float(), norm="ortho")
            out_ft = torch.zeros(b, self.out_ch, sx, sy // 2 + 1, dtype=torch.cfloat, device=x.device)
            out_ft[:, :, : self.modes1, : self.modes2] = self.compl_mul2d(
                x_ft[:, :, : self.modes1, : self.modes2], self.weights1)
            out_ft[:, :, -self.modes1:, : self.modes2] = self.compl_mul2d(
                x_ft[:, :, -self.modes1:, : self.modes2], self.weights2)
            return torch.fft.irfft2(out_ft, s=(sx, sy), norm="ortho")


class ChannelMLP(nn.Module):
    def __init__(self, width, expansion=0.5):
        super().__init__()
        hidden = int(width * expansion)
        self.fc1 = nn.Conv2d(width, hidden, 1)
        self.fc2 = nn.Conv2d(hidden, width, 1)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class InstanceNorm2dAffine(nn.Module):
    def __init__(self, channels, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=(-2, -1), keepdim=True)  # expect: AMP004
        var = x.var(dim=(-2, -1), keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mean) / torch.sqrt(var + self.eps)
        return x * self.weight[None, :, None, None] + self.bias[None, :, None, None]


class FNOBlock(nn.Module):
    def __init__(self, width, modes1, modes2, use_mlp=True):
        super().__init__()
        self.spectral = SpectralConv2d(width, width, modes1, modes2)
        self.skip = nn.Conv2d(width, width, 1)
        self.mlp = ChannelMLP(width) if use_mlp else None
        self.norm = InstanceNorm2dAffine(width) if use_mlp else None

    def forward(self, x):
        x = F.gelu(self.spectral(x) + self.skip(x))
        if self.mlp is not None:
            x = x + self.norm(self.mlp(x))
        return x


class FNO2d(nn.Module):
    def __init__(self, modes1, modes2, width, in_channels=10, out_channels=1, n_layers=4, padding=8):
        super().__init__()
        self.padding = padding
        self.lift = nn.Linear(in_channels + 2, width)
        self.blocks = nn.ModuleList([FNOBlock(width, modes1, modes2, use_mlp=i > 0) for i in range(n_layers)])
        self.project = nn.Sequential(nn.Linear(width, 128), nn.GELU(), nn.Linear(128, out_channels))

    @staticmethod
    def get_grid(shape, device):
        b, sx, sy = shape[0], shape[1], shape[2]
        gridx = torch.linspace(0, 1, sx, device=device).view(1, sx, 1, 1).expand(b, sx, sy, 1)
        gridy = torch.linspace(0, 1, sy, device=device).view(1, 1, sy, 1).expand(b, sx, sy, 1)
        return torch.cat((gridx, gridy), dim=-1)

    def forward(self, x):
        x = torch.cat((x, self.get_grid(x.shape, x.device)), dim=-1)
        x = self.lift(x).permute(0, 3, 1, 2)
        x = F.pad(x, [0, self.padding, 0, self.padding])
        for block in self.blocks:
            x = block(x)
        x = x[..., : -self.padding, : -self.padding].permute(0, 2, 3, 1)
        return self.project(x)


class NSOperator(nn.Module):
    """Predicts (u, v, p); the pressure is only defined up to a constant."""

    def __init__(self, cfg):
        super().__init__()
        self.fno = FNO2d(cfg.modes, cfg.modes, cfg.width, in_channels=3 * cfg.t_in, out_channels=3)

    def forward(self, x):
        out = self.fno(x)
        u, v, p = out[..., 0], out[..., 1], out[..., 2]
        p = p - p.mean(dim=(1, 2), keepdim=True)  # expect: AMP004
        return torch.stack([u, v, p], dim=-1)


MODELS = {
    "fno2d": lambda cfg: FNO2d(cfg.modes, cfg.modes, cfg.width, in_channels=cfg.t_in, out_channels=1),
    "ns-uvp": NSOperator,
}


def build_model(cfg):
    return MODELS[cfg.model](cfg)


class LpLoss:
    """Relative Lp error, averaged over the batch."""

    def __init__(self, p=2, size_average=True):
        self.p = p
        self.size_average = size_average

    def rel(self, x, y):
        n = x.size(0)
        diff_norms = torch.norm(x.reshape(n, -1) - y.reshape(n, -1), self.p, 1)
        y_norms = torch.norm(y.reshape(n, -1), self.p, 1)
        ratio = diff_norms / (y_norms + 1e-8)
        return torch.mean(ratio) if self.size_average else torch.sum(ratio)

    def __call__(self, x, y):
        return self.rel(x, y)


def divergence_penalty(uvp, dx):
    u, v = uvp[..., 0], uvp[..., 1]
    du_dx = (u[:, 2:, 1:-1] - u[:, :-2, 1:-1]) / (2 * dx)
    dv_dy = (v[:, 1:-1, 2:] - v[:, 1:-1, :-2]) / (2 * dx)
    return (du_dx + dv_dy).pow(2).mean()


def load_navier_stokes(path, ntrain, ntest, t_in):
    data = np.load(path)["u"].astype(np.float32)
    a = torch.from_numpy(data[..., :t_in])
    u = torch.from_numpy(data[..., t_in: t_in + 1])
    return a[:ntrain], u[:ntrain], a[-ntest:], u[-ntest:]


@torch.no_grad()
def evaluate(model, loader, x_norm, y_norm, lp, device="cuda"):
    model.eval()
    total, mean_abs = 0.0, 0.0
    for a, u in loader:
        a, u = a.to(device), u.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = model(x_norm.encode(a))
        mean_abs += out.abs().mean().item()
        total += lp(y_norm.decode(out.float()), u).item()
    return total / len(loader), mean_abs / len(loader)


@torch.inference_mode()
def predict_superres(model, a_fine, x_norm, y_norm):
    model_fp16 = copy.deepcopy(model).half().eval()
    out = model_fp16(x_norm.encode(a_fine).half())
    return y_norm.decode(out.float())


def train(cfg):
    device = torch.device("cuda")
    train_a, train_u, test_a, test_u = load_navier_stokes(cfg.data, cfg.ntrain, cfg.ntest, cfg.t_in)
    x_norm = UnitGaussianNormalizer(train_a).to(device)
    y_norm = UnitGaussianNormalizer(train_u).to(device)
    loader = DataLoader(TensorDataset(train_a, train_u), batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    test_loader = DataLoader(TensorDataset(test_a, test_u), batch_size=cfg.batch_size)

    model = build_model(cfg).to(device)
    if cfg.compile:
        model = torch.compile(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * len(loader))
    scaler = torch.amp.GradScaler("cuda")
    lp = LpLoss(size_average=True)

    for epoch in range(cfg.epochs):
        model.train()
        train_l2 = 0.0
        for a, u in loader:
            a, u = a.to(device, non_blocking=True), u.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                out = model(x_norm.encode(a))
                loss = lp(y_norm.decode(out), u)
                if cfg.div_weight > 0:
                    loss = loss + cfg.div_weight * divergence_penalty(out, cfg.dx)
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.step(optimizer)  # expect: AMP006
            scheduler.step()
            train_l2 += loss.item()
        test_l2, test_abs = evaluate(model, test_loader, x_norm, y_norm, lp)
        print(f"epoch {epoch:4d} train {train_l2 / len(loader):.5f} test {test_l2:.5f} |out| {test_abs:.3f}")
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/ns_V1e-3_N5000_T50.npz")
    parser.add_argument("--model", default="fno2d", choices=sorted(MODELS))
    parser.add_argument("--modes", type=int, default=12)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--t-in", type=int, default=10)
    parser.add_argument("--ntrain", type=int, default=1000)
    parser.add_argument("--ntest", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--div-weight", type=float, default=0.0)
    parser.add_argument("--dx", type=float, default=1.0 / 64)
    parser.add_argument("--compile", action="store_true")
    cfg = parser.parse_args()
    model = train(cfg)
    torch.save(model.state_dict(), f"{cfg.model}_ns.pt")


if __name__ == "__main__":
    main()
