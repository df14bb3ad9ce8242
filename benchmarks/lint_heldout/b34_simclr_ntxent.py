"""SimCLR pre-training on CIFAR-10 with the NT-Xent loss.

A small ResNet-free conv encoder, a two-layer projector, LARS and a kNN monitor.

    python b34_simclr_ntxent.py --epochs 200 --batch-size 512 --temperature 0.5 --amp
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class TwoCrops:
    def __init__(self, transform):
        self.transform = transform

    def __call__(self, img):
        return self.transform(img), self.transform(img)


def simclr_transform(size=32):
    return transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.2, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.ToTensor(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)),
    ])


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class ConvEncoder(nn.Module):
    def __init__(self, width=64, feat_dim=512):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, width), conv_bn(width, width),
            conv_bn(width, 2 * width, 2), conv_bn(2 * width, 2 * width),
            conv_bn(2 * width, 4 * width, 2), conv_bn(4 * width, 4 * width),
        )
        self.conv_out = nn.Conv2d(4 * width, feat_dim, 1)
        self.feat_dim = feat_dim

    def forward(self, x):
        x = F.relu(self.conv_out(self.features(x)))
        return x.mean(dim=(2, 3))  # expect: AMP004


class SimCLR(nn.Module):
    def __init__(self, width=64, feat_dim=512, proj_dim=128):
        super().__init__()
        self.encoder = ConvEncoder(width, feat_dim)
        self.projector = nn.Sequential(
            nn.Linear(feat_dim, feat_dim, bias=False),
            nn.BatchNorm1d(feat_dim),
            nn.ReLU(inplace=True),
            nn.Linear(feat_dim, proj_dim),
        )

    def forward(self, x1, x2):
        z1 = self.projector(self.encoder(x1))
        z2 = self.projector(self.encoder(x2))
        return z1, z2


def build_model(args):
    return SimCLR(width=args.width, feat_dim=args.feat_dim, proj_dim=args.proj_dim)


class NTXentLoss(nn.Module):
    """Normalised temperature-scaled cross entropy over 2N views."""

    def __init__(self, temperature=0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z1, z2):
        n = z1.size(0)
        z = F.normalize(torch.cat([z1, z2], dim=0), dim=1)
        sim = torch.mm(z, z.t()) / self.temperature
        self_mask = torch.eye(2 * n, dtype=torch.bool, device=sim.device)
        sim = sim.masked_fill(self_mask, -1e9)  # expect: AMP007
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(sim.device)
        return F.cross_entropy(sim, targets)


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling (You et al., 2017), SGD with momentum."""

    def __init__(self, params, lr, weight_decay=0.0, momentum=0.9, eta=0.001):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                dp = p.grad
                if p.ndim > 1:  # biases and BN parameters are neither decayed nor adapted
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    trust = g["eta"] * param_norm / (update_norm + 1e-9)
                    q = torch.where(param_norm > 0.0, torch.where(update_norm > 0.0, trust, one), one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


class Trainer:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.model = build_model(args)
        self.model.to(self.device)
        self.criterion = NTXentLoss(args.temperature)
        self.optimizer = LARS(self.model.parameters(), lr=args.lr * args.batch_size / 256, weight_decay=1e-6)
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        self.history = {"loss": [], "z_std": []}

    def train_step(self, x1, x2):
        x1 = x1.to(self.device, non_blocking=True)
        x2 = x2.to(self.device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.amp):
            z1, z2 = self.model(x1, x2)
            loss = self.criterion(z1, z2)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

        # collapse monitor (SimSiam, Sec. 4.1): per-dimension std of the l2-normalised output
        with torch.no_grad():
            zn = F.normalize(z1.detach(), dim=1)  # expect: AMP011
            z_std = zn.std(dim=0)  # expect: AMP004
            self.history["z_std"].append(z_std.float().mean().item())
        self.history["loss"].append(loss.item())
        return loss.item()

    def fit(self, loader, epochs):
        for epoch in range(epochs):
            self.model.train()
            running = 0.0
            for step, ((x1, x2), _) in enumerate(loader):
                running += self.train_step(x1, x2)
            print(f"epoch {epoch}: loss {running / (step + 1):.4f} z_std {self.history['z_std'][-1]:.4f}")
            torch.save({"model": self.model.state_dict(), "epoch": epoch}, os.path.join(self.args.out_dir, "last.pt"))


@torch.no_grad()
def knn_monitor(model, memory_loader, test_loader, device, num_classes=10, k=200, t=0.1, amp=True):
    """Weighted kNN accuracy on frozen encoder features (Wu et al., 2018)."""
    model.eval()
    bank, bank_labels = [], []
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        for x, y in memory_loader:
            f = F.normalize(model.encoder(x.to(device)), dim=1)
            bank.append(f.half())
            bank_labels.append(y.to(device))
        bank = torch.cat(bank).t()
        bank_labels = torch.cat(bank_labels)
        correct = total = 0
        for x, y in test_loader:
            y = y.to(device)
            f = F.normalize(model.encoder(x.to(device)), dim=1).half()
            w, idx = (f @ bank).topk(k, dim=-1)
            w = (w / t).exp()
            one_hot = F.one_hot(bank_labels[idx], num_classes).to(w.dtype)
            scores = (one_hot * w.unsqueeze(-1)).sum(dim=1)
            correct += (scores.argmax(-1) == y).sum().item()
            total += y.numel()
    return correct / total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out-dir", default="./runs/simclr")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--feat-dim", type=int, default=512)
    parser.add_argument("--proj-dim", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    train_set = datasets.CIFAR10(args.data, train=True, download=True, transform=TwoCrops(simclr_transform()))
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.workers, pin_memory=True)
    plain = transforms.Compose([transforms.ToTensor(),
                                transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))])
    memory_loader = DataLoader(datasets.CIFAR10(args.data, train=True, transform=plain), batch_size=512)
    test_loader = DataLoader(datasets.CIFAR10(args.data, train=False, transform=plain), batch_size=512)

    trainer = Trainer(args)
    trainer.fit(loader, args.epochs)
    acc = knn_monitor(trainer.model, memory_loader, test_loader, trainer.device, amp=args.amp)
    print(f"kNN top-1: {100 * acc:.2f}")


if __name__ == "__main__":
    main()
