"""Capsule network with dynamic routing (Sabour, Frosst & Hinton, 2017) on 28x28 digits.

Conv1 -> PrimaryCaps (32 maps of 8-D capsules) -> squash -> DigitCaps with routing by
agreement -> squash.  Margin loss on the capsule lengths plus a reconstruction decoder
trained with a hand-written binary cross-entropy (F.binary_cross_entropy refuses to run
under CUDA autocast).  To fit larger batches on one card the whole model is kept in
half precision and the forward pass runs under fp16 autocast.
"""
import argparse
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class CapsOutput(NamedTuple):
    lengths: torch.Tensor
    recon: torch.Tensor


def squash(s, dim=-1):
    """v = |s|^2 / (1 + |s|^2) * s / |s|; the squared norm is a sum (fp32 under autocast)."""
    sq = (s * s).sum(dim=dim, keepdim=True)
    return (sq / (1.0 + sq)) * s / torch.sqrt(sq + 1e-8)


def squash_efficient(s, dim=-1):
    """Efficient-CapsNet squash (Mazzia et al., 2021), with the paper's eps."""
    n = s.norm(dim=dim, keepdim=True)
    return (1.0 - 1.0 / (torch.exp(n) + 1e-20)) * (s / (n + 1e-20))


SQUASH = {"sabour": squash, "efficient": squash_efficient}


class PrimaryCaps(nn.Module):
    def __init__(self, in_ch=256, caps=32, dim=8, squash_fn=squash):
        super().__init__()
        self.caps, self.dim = caps, dim
        self.conv = nn.Conv2d(in_ch, caps * dim, 9, stride=2)
        self.squash_fn = squash_fn

    def forward(self, x):
        u = self.conv(x)
        b = u.size(0)
        u = u.view(b, self.caps, self.dim, -1).permute(0, 1, 3, 2).reshape(b, -1, self.dim)
        return self.squash_fn(u)


class DigitCaps(nn.Module):
    def __init__(self, in_caps=1152, in_dim=8, out_caps=10, out_dim=16, iters=3):
        super().__init__()
        self.iters = iters
        self.W = nn.Parameter(0.01 * torch.randn(1, in_caps, out_caps, out_dim, in_dim))

    def forward(self, u):
        u_hat = torch.matmul(self.W, u[:, :, None, :, None]).squeeze(-1)
        u_hat_detached = u_hat.detach()
        b_ij = torch.zeros(u_hat.shape[:3], device=u_hat.device)
        for i in range(self.iters):
            c_ij = F.softmax(b_ij, dim=2)
            if i == self.iters - 1:
                v_j = squash((c_ij.unsqueeze(-1) * u_hat).sum(dim=1))
            else:
                v_j = squash((c_ij.unsqueeze(-1) * u_hat_detached).sum(dim=1))
                b_ij = b_ij + (u_hat_detached * v_j.unsqueeze(1)).sum(dim=-1)
        return v_j


class Decoder(nn.Module):
    def __init__(self, caps=10, dim=16, out=784):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(caps * dim, 512), nn.ReLU(inplace=True),
            nn.Linear(512, 1024), nn.ReLU(inplace=True),
            nn.Linear(1024, out),
        )

    def forward(self, v, mask):
        masked = (v * mask[:, :, None]).flatten(1)
        return torch.sigmoid(self.net(masked))


class CapsNet(nn.Module):
    def __init__(self, routing_iters=3, squash_kind="sabour"):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 256, 9)
        self.primary = PrimaryCaps(squash_fn=SQUASH[squash_kind])
        self.digits = DigitCaps(iters=routing_iters)
        self.decoder = Decoder()

    def forward(self, x, y_onehot=None):
        h = F.relu(self.conv1(x))
        v = self.digits(self.primary(h))
        lengths = torch.sqrt((v * v).sum(dim=-1) + 1e-8)
        if y_onehot is None:
            y_onehot = F.one_hot(lengths.argmax(dim=1), lengths.size(1)).to(v.dtype)
        return CapsOutput(lengths, self.decoder(v, y_onehot))


def margin_loss(lengths, y_onehot, m_pos=0.9, m_neg=0.1, lam=0.5):
    pos = y_onehot * F.relu(m_pos - lengths).pow(2)
    neg = lam * (1.0 - y_onehot) * F.relu(lengths - m_neg).pow(2)
    return (pos + neg).sum(dim=1).mean()


def reconstruction_bce(recon, images):
    target = images.flatten(1)
    log_p = torch.log(recon + 1e-10)  # expect: AMP011
    log_q = torch.log((1.0 - recon).clamp(min=1e-10))  # expect: AMP011
    return -(target * log_p + (1.0 - target) * log_q).sum(dim=1).mean()


def shift_augment(x, max_shift=2):
    dx, dy = torch.randint(-max_shift, max_shift + 1, (2,)).tolist()
    return torch.roll(x, shifts=(dy, dx), dims=(2, 3))


@torch.no_grad()
def evaluate(model, batches, device):
    model.eval()
    correct, n, recon_err = 0, 0, 0.0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        correct += (out.lengths.argmax(dim=1) == y).sum().item()
        recon_err += (out.recon.float() - x.flatten(1)).abs().sum().item()
        n += y.size(0)
    model.train()
    return correct / n, recon_err / n


def digit_batches(n_batches, batch_size, seed):
    g = torch.Generator().manual_seed(seed)
    templates = (torch.rand(10, 1, 28, 28, generator=g) > 0.7).float()
    out = []
    for _ in range(n_batches):
        y = torch.randint(0, 10, (batch_size,), generator=g)
        x = (templates[y] + 0.2 * torch.rand(batch_size, 1, 28, 28, generator=g)).clamp(0.0, 1.0)
        out.append((x, y))
    return out


def train(args):
    device = torch.device("cuda")
    model = CapsNet(args.routing, args.squash).to(device).half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.96)
    train_batches = digit_batches(300, args.batch_size, seed=0)
    test_batches = digit_batches(20, 256, seed=1)

    for epoch in range(args.epochs):
        running_margin, running_recon = 0.0, 0.0
        for x, y in train_batches:
            x, y = shift_augment(x).to(device), y.to(device)
            y1 = F.one_hot(y, 10).float()
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                out = model(x, y1)
                m_loss = margin_loss(out.lengths, y1)
                r_loss = reconstruction_bce(out.recon, x)
                loss = m_loss + args.recon_weight * r_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running_margin += m_loss.item()
            running_recon += r_loss.item()
        scheduler.step()

        acc, err = evaluate(model, test_batches, device)
        print(f"epoch {epoch}: margin {running_margin / len(train_batches):.4f} "
              f"recon {running_recon / len(train_batches):.2f} test acc {acc:.4f} "
              f"L1 recon {err:.2f} lr {scheduler.get_last_lr()[0]:.2e}")
    return model


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--routing", type=int, default=3)
    p.add_argument("--squash", choices=sorted(SQUASH), default="sabour")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--recon-weight", type=float, default=0.0005 * 784)
    p.add_argument("--out", default="capsnet.pt")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = train(args)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
