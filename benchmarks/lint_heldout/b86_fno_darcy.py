"""Train a 2-D Fourier Neural Operator on the Darcy flow benchmark.

Follows the setup of Li et al. (2021): 421x421 fields sub-sampled to 85x85,
relative L2 loss, Adam with step decay.
"""
import argparse
import time

import scipy.io
import torch
import torch.nn as nn
import torch.nn.functional as F


class UnitGaussianNormalizer:
    def __init__(self, x, eps=0.00001):
        self.mean = torch.mean(x, 0)
        self.std = torch.std(x, 0)
        self.eps = eps

    def encode(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def decode(self, x):
        std = self.std + self.eps
        return x * std + self.mean

    def to(self, device):
        self.mean = self.mean.to(device)
        self.std = self.std.to(device)
        return self


class LpLoss:
    """Relative Lp error, summed (or averaged) over the batch."""

    def __init__(self, p=2, size_average=True):
        self.p = p
        self.size_average = size_average

    def rel(self, x, y):
        num_examples = x.size(0)
        diff_norms = torch.norm(x.reshape(num_examples, -1) - y.reshape(num_examples, -1), self.p, 1)
        y_norms = torch.norm(y.reshape(num_examples, -1), self.p, 1)
        ratio = diff_norms / y_norms
        return ratio.mean() if self.size_average else ratio.sum()

    def __call__(self, x, y):
        return self.rel(x, y)


class SpectralConv2d(nn.Module):
    def __init__(self, in_channels, out_channels, modes1, modes2):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.modes1 = modes1
        self.modes2 = modes2
        scale = 1 / (in_channels * out_channels)
        self.weights1 = nn.Parameter(scale * torch.rand(in_channels, out_channels, modes1, modes2, dtype=torch.cfloat))
        self.weights2 = nn.Parameter(scale * torch.rand(in_channels, out_channels, modes1, modes2, dtype=torch.cfloat))

    @staticmethod
    def compl_mul2d(inp, weights):
        return torch.einsum("bixy,ioxy->boxy", inp, weights)

    def forward(self, x):
        batchsize = x.shape[0]
        h, w = x.size(-2), x.size(-1)
        # cuFFT has no half-precision path for arbitrary sizes; keep the spectral part in fp32
        with torch.autocast(device_type="cuda", enabled=False):
            x_ft = torch.fft.rfft2(x.float())
            out_ft = torch.zeros(batchsize, self.out_channels, h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
            out_ft[:, :, : self.modes1, : self.modes2] = self.compl_mul2d(x_ft[:, :, : self.modes1, : self.modes2], self.weights1)
            out_ft[:, :, -self.modes1 :, : self.modes2] = self.compl_mul2d(x_ft[:, :, -self.modes1 :, : self.modes2], self.weights2)
            out = torch.fft.irfft2(out_ft, s=(h, w))
        return out


class FNO2d(nn.Module):
    def __init__(self, modes1, modes2, width, n_layers=4):
        super().__init__()
        self.width = width
        self.padding = 9
        self.fc0 = nn.Linear(3, width)
        self.spectral = nn.ModuleList([SpectralConv2d(width, width, modes1, modes2) for _ in range(n_layers)])
        self.pointwise = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(n_layers)])
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, 1)

    @staticmethod
    def get_grid(shape, device):
        batchsize, size_x, size_y = shape[0], shape[1], shape[2]
        gridx = torch.linspace(0, 1, size_x, dtype=torch.float32, device=device)
        gridx = gridx.reshape(1, size_x, 1, 1).repeat(batchsize, 1, size_y, 1)
        gridy = torch.linspace(0, 1, size_y, dtype=torch.float32, device=device)
        gridy = gridy.reshape(1, 1, size_y, 1).repeat(batchsize, size_x, 1, 1)
        return torch.cat((gridx, gridy), dim=-1)

    def forward(self, x):
        grid = self.get_grid(x.shape, x.device)
        x = torch.cat((x, grid), dim=-1)
        x = self.fc0(x)
        x = x.permute(0, 3, 1, 2)
        x = F.pad(x, [0, self.padding, 0, self.padding])
        for i, (spec, pw) in enumerate(zip(self.spectral, self.pointwise)):
            x = spec(x) + pw(x)
            if i < len(self.spectral) - 1:
                x = F.gelu(x)
        x = x[..., : -self.padding, : -self.padding]
        x = x.permute(0, 2, 3, 1)
        x = F.gelu(self.fc1(x))
        return self.fc2(x)


def load_darcy(path, ntrain, r, s):
    data = scipy.io.loadmat(path)
    coeff = torch.from_numpy(data["coeff"]).float()[:ntrain, ::r, ::r][:, :s, :s]
    sol = torch.from_numpy(data["sol"]).float()[:ntrain, ::r, ::r][:, :s, :s]
    return coeff, sol


def train(args):
    device = torch.device("cuda")
    s = int(((421 - 1) / args.r) + 1)
    x_train, y_train = load_darcy(args.train_path, args.ntrain, args.r, s)
    x_test, y_test = load_darcy(args.test_path, args.ntest, args.r, s)

    x_normalizer = UnitGaussianNormalizer(x_train)
    x_train, x_test = x_normalizer.encode(x_train), x_normalizer.encode(x_test)
    y_normalizer = UnitGaussianNormalizer(y_train)
    y_train = y_normalizer.encode(y_train)
    y_normalizer.to(device)

    x_train, x_test = x_train.reshape(args.ntrain, s, s, 1), x_test.reshape(args.ntest, s, s, 1)
    train_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True
    )
    test_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_test, y_test), batch_size=args.batch_size, shuffle=False
    )

    model = FNO2d(args.modes, args.modes, args.width).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=0.5)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    myloss = LpLoss(size_average=False)

    for ep in range(args.epochs):
        model.train()
        t0 = time.perf_counter()
        train_l2 = 0.0
        for a, u in train_loader:
            a, u = a.to(device, non_blocking=True), u.to(device, non_blocking=True)
            bs = a.size(0)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                out = model(a).reshape(bs, s, s)
                # Darcy solutions on the unit square should keep their mean; penalise drift
                mass_penalty = (out.mean(dim=(1, 2)) - u.mean(dim=(1, 2))).pow(2).mean()  # expect: AMP004
            data_loss = myloss(out.view(bs, -1), u.view(bs, -1))  # expect: AMP002
            loss = data_loss + args.mass_weight * mass_penalty
            scaler.scale(loss).backward()
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            train_l2 += data_loss.item()
        scheduler.step()

        test_l2 = evaluate(model, test_loader, y_normalizer, myloss, s, device)
        print(
            f"epoch {ep:4d} | {time.perf_counter() - t0:6.2f}s | "
            f"train {train_l2 / args.ntrain:.5f} | test {test_l2 / args.ntest:.5f}"
        )
    return model


@torch.no_grad()
def evaluate(model, loader, y_normalizer, myloss, s, device):
    model.eval()
    total = 0.0
    for a, u in loader:
        a, u = a.to(device), u.to(device)
        bs = a.size(0)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = model(a).reshape(bs, s, s)
        out = y_normalizer.decode(out.float())
        total += myloss(out.view(bs, -1), u.view(bs, -1)).item()
    return total


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train-path", default="data/piececonst_r421_N1024_smooth1.mat")
    p.add_argument("--test-path", default="data/piececonst_r421_N1024_smooth2.mat")
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=100)
    p.add_argument("--r", type=int, default=5)
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--step-size", type=int, default=100)
    p.add_argument("--mass-weight", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    torch.manual_seed(0)
    trained = train(args)
    torch.save(trained.state_dict(), f"fno_darcy_m{args.modes}_w{args.width}.pt")
