"""Multi-scale Glow (ActNorm -> invertible 1x1 conv -> affine coupling) trained by maximum
likelihood on CIFAR-10 / CelebA-64, reporting bits per dimension.
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def squeeze2d(x):
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unsqueeze2d(x):
    b, c, h, w = x.shape
    x = x.view(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


def gaussian_log_p(x, mean, log_sd):
    return -0.5 * math.log(2 * math.pi) - log_sd - 0.5 * (x - mean) ** 2 / torch.exp(2 * log_sd)


class ActNorm2d(nn.Module):
    """Per-channel affine flow with data-dependent initialisation."""

    def __init__(self, num_channels):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, num_channels, 1, 1))
        self.log_scale = nn.Parameter(torch.zeros(1, num_channels, 1, 1))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    @torch.no_grad()
    def initialize(self, x):
        flat = x.float().permute(1, 0, 2, 3).reshape(x.size(1), -1)
        mean = flat.mean(dim=1).view(1, -1, 1, 1)
        std = flat.std(dim=1).view(1, -1, 1, 1)
        self.loc.data.copy_(-mean)
        self.log_scale.data.copy_(torch.log(1.0 / (std + 1e-6)))
        self.initialized.fill_(1)

    def forward(self, x):
        if self.initialized.item() == 0:
            self.initialize(x)
        _, _, H, W = x.shape
        y = (x + self.loc) * torch.exp(self.log_scale)
        return y, H * W * torch.sum(self.log_scale)

    def reverse(self, y):
        return y * torch.exp(-self.log_scale) - self.loc


class InvConv2dLU(nn.Module):
    def __init__(self, num_channels):
        super().__init__()
        w = torch.linalg.qr(torch.randn(num_channels, num_channels))[0]
        P, L, U = torch.linalg.lu(w)
        s = torch.diagonal(U)
        self.register_buffer("w_p", P)
        self.register_buffer("u_mask", torch.triu(torch.ones_like(U), 1))
        self.register_buffer("l_mask", torch.triu(torch.ones_like(U), 1).T.contiguous())
        self.register_buffer("s_sign", torch.sign(s))
        self.register_buffer("l_eye", torch.eye(num_channels))
        self.w_l = nn.Parameter(L)
        self.w_s = nn.Parameter(torch.log(torch.abs(s)))
        self.w_u = nn.Parameter(torch.triu(U, 1))

    def calc_weight(self):
        lower = self.w_l * self.l_mask + self.l_eye
        upper = self.w_u * self.u_mask + torch.diag(self.s_sign * torch.exp(self.w_s))
        return (self.w_p @ lower @ upper).unsqueeze(2).unsqueeze(3)

    def forward(self, x):
        _, _, H, W = x.shape
        out = F.conv2d(x, self.calc_weight())
        return out, H * W * torch.sum(self.w_s)

    def reverse(self, y):
        weight = self.calc_weight().squeeze()
        return F.conv2d(y, weight.inverse().unsqueeze(2).unsqueeze(3))


class HiddenActNorm(nn.Module):
    """ActNorm for the coupling network's hidden activations (no log-determinant needed)."""

    def __init__(self, num_channels):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1, num_channels, 1, 1))
        self.logs = nn.Parameter(torch.zeros(1, num_channels, 1, 1))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x):
        if self.initialized.item() == 0:
            with torch.no_grad():
                mean = x.mean(dim=(0, 2, 3), keepdim=True)  # expect: AMP004
                std = x.std(dim=(0, 2, 3), keepdim=True)  # expect: AMP004
                self.bias.data.copy_(-mean)
                self.logs.data.copy_(torch.log(1.0 / (std + 1e-6)))
                self.initialized.fill_(1)
        return (x + self.bias) * torch.exp(self.logs)


class CouplingNet(nn.Module):
    def __init__(self, in_ch, out_ch, hidden=512):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, hidden, 3, padding=1, bias=False)
        self.norm1 = HiddenActNorm(hidden)
        self.conv2 = nn.Conv2d(hidden, hidden, 1, bias=False)
        self.norm2 = HiddenActNorm(hidden)
        self.conv_out = nn.Conv2d(hidden, out_ch, 3, padding=1)
        # start every coupling as the identity
        self.conv_out.weight.data.zero_()
        self.conv_out.bias.data.zero_()

    def forward(self, x):
        h = F.relu(self.norm1(self.conv1(x)))
        h = F.relu(self.norm2(self.conv2(h)))
        return self.conv_out(h)


class AffineCoupling(nn.Module):
    def __init__(self, num_channels, hidden=512):
        super().__init__()
        self.net = CouplingNet(num_channels // 2, num_channels, hidden)

    def forward(self, x):
        x_a, x_b = x.chunk(2, dim=1)
        h = self.net(x_a)
        shift = h[:, 0::2]
        scale = torch.sigmoid(h[:, 1::2] + 2.0)
        y_b = (x_b + shift) * scale
        log_det = torch.log(scale + 1e-10).flatten(1).sum(dim=1)  # expect: AMP011
        return torch.cat([x_a, y_b], dim=1), log_det

    def reverse(self, y):
        y_a, y_b = y.chunk(2, dim=1)
        h = self.net(y_a)
        shift = h[:, 0::2]
        scale = torch.sigmoid(h[:, 1::2] + 2.0)
        return torch.cat([y_a, y_b / scale - shift], dim=1)


class FlowStep(nn.Module):
    def __init__(self, num_channels, hidden):
        super().__init__()
        self.actnorm = ActNorm2d(num_channels)
        self.invconv = InvConv2dLU(num_channels)
        self.coupling = AffineCoupling(num_channels, hidden)

    def forward(self, x):
        x, ld0 = self.actnorm(x)
        x, ld1 = self.invconv(x)
        x, ld2 = self.coupling(x)
        return x, ld0 + ld1 + ld2

    def reverse(self, y):
        y = self.coupling.reverse(y)
        y = self.invconv.reverse(y)
        return self.actnorm.reverse(y)


class FlowBlock(nn.Module):
    def __init__(self, in_ch, n_flows, hidden, split=True):
        super().__init__()
        sq = in_ch * 4
        self.flows = nn.ModuleList([FlowStep(sq, hidden) for _ in range(n_flows)])
        self.split = split
        self.prior = nn.Conv2d(in_ch * 2 if split else sq, sq if split else sq * 2, 3, padding=1)
        self.prior.weight.data.zero_()
        self.prior.bias.data.zero_()

    def forward(self, x):
        x = squeeze2d(x)
        log_det = 0
        for flow in self.flows:
            x, ld = flow(x)
            log_det = log_det + ld
        if self.split:
            x, z_new = x.chunk(2, dim=1)
            mean, log_sd = self.prior(x).chunk(2, dim=1)
        else:
            z_new = x
            mean, log_sd = self.prior(torch.zeros_like(x)).chunk(2, dim=1)
        log_p = gaussian_log_p(z_new, mean, log_sd).flatten(1).sum(dim=1)
        return x, log_det, log_p

    def reverse(self, x, eps, temperature=1.0):
        if self.split:
            mean, log_sd = self.prior(x).chunk(2, dim=1)
            x = torch.cat([x, mean + torch.exp(log_sd) * eps * temperature], dim=1)
        else:
            mean, log_sd = self.prior(torch.zeros_like(eps)).chunk(2, dim=1)
            x = mean + torch.exp(log_sd) * eps * temperature
        for flow in reversed(self.flows):
            x = flow.reverse(x)
        return unsqueeze2d(x)


class Glow(nn.Module):
    def __init__(self, in_ch=3, n_flows=32, n_blocks=3, hidden=512, img_size=32):
        super().__init__()
        self.blocks = nn.ModuleList()
        self.z_shapes = []
        ch, size = in_ch, img_size
        for i in range(n_blocks):
            last = i == n_blocks - 1
            self.blocks.append(FlowBlock(ch, n_flows, hidden, split=not last))
            size //= 2
            self.z_shapes.append((ch * 4 if last else ch * 2, size, size))
            ch *= 2

    def forward(self, x):
        log_p_total, log_det_total = 0, 0
        for block in self.blocks:
            x, log_det, log_p = block(x)
            log_det_total = log_det_total + log_det
            log_p_total = log_p_total + log_p
        return log_p_total, log_det_total

    @torch.no_grad()
    def sample(self, n, temperature=0.7, device="cuda"):
        x = None
        for block, shape in zip(reversed(self.blocks), reversed(self.z_shapes)):
            eps = torch.randn(n, *shape, device=device)
            x = block.reverse(eps if x is None else x, eps, temperature)
        return x


def preprocess(images, n_bits):
    # images in [0, 1] -> n_bits quantisation, centred on zero
    x = images * 255
    if n_bits < 8:
        x = torch.floor(x / 2 ** (8 - n_bits))
    return x / 2 ** n_bits - 0.5


def nll_bits_per_dim(log_p, log_det, n_pixel, n_bins):
    ll = -math.log(n_bins) * n_pixel + log_det + log_p
    return (-ll / (math.log(2) * n_pixel)).mean()


def train(args):
    device = torch.device("cuda")
    tfm = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor()])
    dataset = datasets.CIFAR10(args.data, train=True, download=False, transform=tfm)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)

    model = Glow(3, args.n_flows, args.n_blocks, args.hidden, img_size=32).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    n_bins = 2.0 ** args.n_bits
    n_pixel = 32 * 32 * 3

    step, best_bpd = 0, float("inf")
    for epoch in range(args.epochs):
        for images, _ in loader:
            x = preprocess(images.to(device, non_blocking=True), args.n_bits)
            lr = min(args.lr, args.lr * (step + 1) / args.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr

            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                log_p, log_det = model(x + torch.rand_like(x) / n_bins)
                loss = nll_bits_per_dim(log_p, log_det, n_pixel, n_bins)
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()

            if step % args.log_every == 0:
                print(f"epoch {epoch} step {step} bpd {loss.item():.3f} grad {grad_norm.item():.2f} lr {lr:.2e}")
            if step % args.sample_every == 0:
                samples = model.sample(args.n_sample, args.temperature, device) + 0.5
                np.save(os.path.join(args.out_dir, f"samples_{step:07d}.npy"), samples.clamp(0, 1).cpu().numpy())
            if loss.item() < best_bpd:
                best_bpd = loss.item()
            step += 1
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                   os.path.join(args.out_dir, f"glow_{epoch:03d}.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/cifar10")
    parser.add_argument("--out_dir", default="runs/glow")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--n_flows", type=int, default=32)
    parser.add_argument("--n_blocks", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--n_bits", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=4000)
    parser.add_argument("--max_grad_norm", type=float, default=50.0)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--n_sample", type=int, default=16)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--sample_every", type=int, default=2000)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args)
