"""Capsule network with dynamic routing (Sabour et al., 2017) on MNIST.

Runs on CPU; bfloat16 autocast (--bf16) roughly halves the epoch time on CPUs
with AMX / AVX512-BF16.

    python b34_capsnet_routing.py --epochs 30 --bf16
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def squash(s, dim=-1):
    """Capsule non-linearity: short vectors shrink to ~0, long ones to just below 1."""
    sq_norm = (s * s).sum(dim=dim, keepdim=True)  # expect: AMP004
    scale = sq_norm / (1.0 + sq_norm)
    return scale * s / torch.sqrt(sq_norm + 1e-8)


class PrimaryCaps(nn.Module):
    def __init__(self, in_channels=256, n_caps=32, caps_dim=8, kernel_size=9, stride=2):
        super().__init__()
        self.n_caps, self.caps_dim = n_caps, caps_dim
        self.conv = nn.Conv2d(in_channels, n_caps * caps_dim, kernel_size, stride)

    def forward(self, x):
        u = self.conv(x)
        b, _, h, w = u.shape
        u = u.view(b, self.n_caps, self.caps_dim, h, w).permute(0, 1, 3, 4, 2)
        return squash(u.reshape(b, -1, self.caps_dim))


class DigitCaps(nn.Module):
    def __init__(self, n_in=32 * 6 * 6, in_dim=8, n_out=10, out_dim=16, routing_iters=3):
        super().__init__()
        self.W = nn.Parameter(0.01 * torch.randn(1, n_out, n_in, out_dim, in_dim))
        self.routing_iters = routing_iters

    def forward(self, u):
        # u: (B, n_in, in_dim) -> predictions u_hat: (B, n_out, n_in, out_dim)
        u_hat = torch.matmul(self.W, u[:, None, :, :, None]).squeeze(-1)
        b = torch.zeros(*u_hat.shape[:3], 1, dtype=u_hat.dtype, device=u_hat.device)
        for i in range(self.routing_iters):
            c = F.softmax(b, dim=1)
            s = (c * u_hat).sum(dim=2)  # expect: AMP004
            v = squash(s)
            if i < self.routing_iters - 1:
                b = b + (u_hat * v.unsqueeze(2)).sum(dim=-1, keepdim=True)  # expect: AMP004
        return v


class CapsNet(nn.Module):
    def __init__(self, routing_iters=3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 256, 9)
        self.primary = PrimaryCaps()
        self.digits = DigitCaps(routing_iters=routing_iters)
        self.decoder = nn.Sequential(
            nn.Linear(16 * 10, 512), nn.ReLU(inplace=True),
            nn.Linear(512, 1024), nn.ReLU(inplace=True),
            nn.Linear(1024, 784), nn.Sigmoid(),
        )

    def forward(self, x, y=None):
        v = self.digits(self.primary(F.relu(self.conv1(x))))
        lengths = torch.sqrt((v * v).sum(dim=-1))  # expect: AMP004
        if y is None:
            y = lengths.argmax(dim=1)
        mask = F.one_hot(y, num_classes=10).to(v.dtype)
        recon = self.decoder((v * mask.unsqueeze(-1)).flatten(1))
        return lengths, recon


class CapsuleLoss(nn.Module):
    """Margin loss on the capsule lengths plus a down-weighted reconstruction loss."""

    def __init__(self, m_pos=0.9, m_neg=0.1, lam=0.5, recon_weight=0.0005):
        super().__init__()
        self.m_pos, self.m_neg, self.lam = m_pos, m_neg, lam
        self.recon_weight = recon_weight
        self.bce = nn.BCELoss(reduction="sum")

    def forward(self, lengths, labels, recon, images):
        lengths = lengths.float()  # margins of 0.1 do not survive bf16 rounding near 1
        targets = F.one_hot(labels, num_classes=lengths.size(1)).to(lengths.dtype)
        pos = F.relu(self.m_pos - lengths)
        neg = F.relu(lengths - self.m_neg)
        margin = (targets * pos * pos + self.lam * (1.0 - targets) * neg * neg).sum(dim=1)
        recon_loss = self.bce(recon, images.flatten(1))  # expect: AMP003
        return margin.mean() + self.recon_weight * recon_loss / images.size(0)


def train_epoch(model, criterion, loader, optimizer, epoch, args):
    model.train()
    t0, total, correct, seen = time.time(), 0.0, 0, 0
    for step, (images, labels) in enumerate(loader):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            lengths, recon = model(images, labels)
            loss = criterion(lengths, labels, recon, images)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        total += loss.item() * images.size(0)
        correct += (lengths.argmax(dim=1) == labels).sum().item()
        seen += images.size(0)
        if step % args.log_every == 0:
            print(f"epoch {epoch} step {step:4d} loss {total / seen:.4f} acc {correct / seen:.4f}")
    return total / seen, time.time() - t0


@torch.no_grad()
def evaluate(model, criterion, loader):
    model.eval()
    total, correct, seen = 0.0, 0, 0
    for images, labels in loader:
        lengths, recon = model(images)
        total += criterion(lengths, labels, recon, images).item() * images.size(0)
        correct += (lengths.argmax(dim=1) == labels).sum().item()
        seen += images.size(0)
    return total / seen, correct / seen


def main():
    parser = argparse.ArgumentParser(description="CapsNet on MNIST (CPU)")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-decay", type=float, default=0.96)
    parser.add_argument("--routing-iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    train_tf = transforms.Compose([transforms.RandomCrop(28, padding=2), transforms.ToTensor()])
    train_loader = DataLoader(datasets.MNIST(args.data, train=True, download=True, transform=train_tf),
                              batch_size=args.batch_size, shuffle=True, num_workers=4)
    test_loader = DataLoader(datasets.MNIST(args.data, train=False, transform=transforms.ToTensor()),
                             batch_size=512)

    model = CapsNet(args.routing_iters)
    criterion = CapsuleLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)
    best = 0.0
    for epoch in range(args.epochs):
        train_loss, secs = train_epoch(model, criterion, train_loader, optimizer, epoch, args)
        scheduler.step()
        test_loss, acc = evaluate(model, criterion, test_loader)
        print(f"epoch {epoch}: train {train_loss:.4f} ({secs:.0f}s) test {test_loss:.4f} acc {acc:.4f}")
        if acc > best:
            best = acc
            torch.save(model.state_dict(), "capsnet_best.pt")


if __name__ == "__main__":
    main()
