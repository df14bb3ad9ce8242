"""FBCNet-style motor-imagery EEG decoder with a temporal attention branch.

Filter-bank input (9 band-pass bands), depthwise spatial convolution,
log-variance temporal pooling, plus self-attention over short-window band
power.  Cross-subject pre-training on BCI Competition IV-2a, then per-subject
calibration of a subject-specific head.
"""
import argparse
import math
import os
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.signal import butter, sosfiltfilt
from torch.utils.data import DataLoader, TensorDataset

FS = 250
FILTER_BANK = [(4, 8), (8, 12), (12, 16), (16, 20), (20, 24), (24, 28), (28, 32), (32, 36), (36, 40)]


def filter_bank(trials, fs=FS):
    """[n, electrodes, time] -> [n, bands, electrodes, time]"""
    out = np.empty((trials.shape[0], len(FILTER_BANK)) + trials.shape[1:], dtype=np.float32)
    for i, (lo, hi) in enumerate(FILTER_BANK):
        sos = butter(4, [lo, hi], btype="bandpass", fs=fs, output="sos")
        out[:, i] = sosfiltfilt(sos, trials, axis=-1)
    return out


def euclidean_alignment(trials):
    covs = np.stack([t @ t.T / t.shape[-1] for t in trials])
    evals, evecs = np.linalg.eigh(covs.mean(axis=0))
    inv_sqrt = evecs @ np.diag(1.0 / np.sqrt(np.maximum(evals, 1e-10))) @ evecs.T
    return np.stack([inv_sqrt @ t for t in trials])


def standardize(trials):
    mu = trials.mean(axis=-1, keepdims=True)
    sd = trials.std(axis=-1, keepdims=True)
    return (trials - mu) / (sd + 1e-8)


def make_conv(kind: str, in_ch: int, out_ch: int, n_electrodes: int = 22, kernel: int = 25, groups: int = 1) -> nn.Conv2d:
    if kind == "temporal":
        return nn.Conv2d(in_ch, out_ch, (1, kernel), padding=(0, kernel // 2), groups=groups, bias=False)
    if kind == "spatial":
        return nn.Conv2d(in_ch, out_ch, (n_electrodes, 1), groups=groups, bias=False)
    if kind == "pointwise":
        return nn.Conv2d(in_ch, out_ch, 1, bias=False)
    raise ValueError(f"unknown conv kind {kind!r}")


class LogVarLayer(nn.Module):
    """Log of the variance over each temporal window (FBCNet's temporal layer)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.log(torch.clamp(x.var(dim=self.dim, keepdim=True), 1e-6, 1e6))  # expect: AMP004


class TemporalAttentionBranch(nn.Module):
    """Self-attention over the log band power of short windows of the spatially filtered signal."""

    def __init__(self, channels: int, window: int = 50, dim: int = 64, num_heads: int = 4):
        super().__init__()
        self.window, self.dim, self.num_heads = window, dim, num_heads
        self.proj = nn.Linear(channels, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, valid):
        # x: [B, C, 1, T] ; valid: [B, T // window] windows that hold signal
        B, C, _, T = x.shape
        w = x.reshape(B, C, T // self.window, self.window)
        power = (w * w).mean(dim=-1)  # expect: AMP004
        tokens = self.proj(torch.log(power + 1e-10).transpose(1, 2))  # expect: AMP011
        q, k, v = self.qkv(tokens).view(B, -1, 3, self.num_heads, self.dim // self.num_heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~valid[:, None, None, :], -1e9)  # expect: AMP007
        ctx = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, -1, self.dim)
        return self.out(ctx).amax(dim=1)


class FBCNet(nn.Module):
    def __init__(self, n_electrodes=22, n_bands=9, m=32, n_classes=4, stride_factor=4, n_subjects=9, dropout=0.5):
        super().__init__()
        self.stride_factor = stride_factor
        self.scb = make_conv("spatial", n_bands, m * n_bands, n_electrodes, groups=n_bands)
        self.temporal_layer = LogVarLayer(dim=3)
        self.attn_branch = TemporalAttentionBranch(m * n_bands)
        feat_dim = m * n_bands * stride_factor + self.attn_branch.dim
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(feat_dim, n_classes)
        # one calibration head per subject
        for s in range(n_subjects):
            setattr(self, f"subject_head{s}", nn.Linear(feat_dim, n_classes))

    def forward(self, x, valid, subject: Optional[int] = None):
        z = self.scb(x)  # [B, m * n_bands, 1, T]
        attn_feat = self.attn_branch(z, valid)
        z = z.reshape(*z.shape[:2], self.stride_factor, z.shape[3] // self.stride_factor)
        z = torch.flatten(self.temporal_layer(z), start_dim=1)
        feat = torch.cat([z, attn_feat.float()], dim=1)
        head = self.classifier if subject is None else getattr(self, f"subject_head{subject}")
        return head(self.dropout(feat))


def train(model, loader, optimizer, scaler, device, epochs, use_amp=True):
    model.train()
    for epoch in range(epochs):
        total, correct, running = 0, 0, 0.0
        for x, valid, y in loader:
            x, valid, y = x.to(device), valid.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                logits = model(x, valid)
                loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # expect: AMP006
            running += loss.item() * y.size(0)
            correct += (logits.argmax(1) == y).sum().item()
            total += y.size(0)
        print(f"epoch {epoch}: loss {running / total:.4f} acc {correct / total:.3f}")


def finetune_subject(model, loader, subject, device, epochs=30, lr=1e-3):
    """Calibrate the subject head on a handful of trials from the new session."""
    model = model.half()  # expect: AMP001
    head = getattr(model, f"subject_head{subject}")
    optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9)
    model.train()
    for _ in range(epochs):
        for x, valid, y in loader:
            x = x.to(device).half()  # expect: AMP001
            logits = model(x, valid.to(device), subject=subject)
            loss = F.cross_entropy(logits.float(), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


@torch.no_grad()
def evaluate(model, loader, device, subject=None):
    model.eval()
    correct = total = 0
    for x, valid, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x.to(device), valid.to(device), subject=subject)
        correct += (logits.argmax(1).cpu() == y).sum().item()
        total += y.numel()
    model.train()
    return correct / max(total, 1)


def load_subject(root, subject, session, window=50):
    data = np.load(os.path.join(root, f"A{subject + 1:02d}{session}.npz"))
    trials = standardize(euclidean_alignment(data["X"].astype(np.float64)))
    x = filter_bank(trials)
    lengths = data.get("lengths", np.full(len(x), x.shape[-1]))
    n_win = x.shape[-1] // window
    valid = np.arange(n_win)[None, :] * window < lengths[:, None]
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(valid), torch.from_numpy(data["y"].astype(np.int64)))


def main():
    parser = argparse.ArgumentParser(description="FBCNet cross-subject pre-training + calibration")
    parser.add_argument("--root", required=True)
    parser.add_argument("--target-subject", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--amp", action="store_true", help="mixed precision (autocast + GradScaler)")
    parser.add_argument("--fp16", action="store_true", help="keep the weights in half precision")
    args = parser.parse_args()
    device = torch.device("cuda")

    sources = [s for s in range(9) if s != args.target_subject]
    train_set = torch.utils.data.ConcatDataset([load_subject(args.root, s, "T") for s in sources])
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)

    model = FBCNet().to(device)
    if args.fp16:
        model = model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)  # expect: AMP011
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    train(model, loader, optimizer, scaler, device, args.epochs, use_amp=args.amp)

    target = load_subject(args.root, args.target_subject, "E")
    n_cal = len(target) // 5
    cal_set, test_set = torch.utils.data.random_split(target, [n_cal, len(target) - n_cal], generator=torch.Generator().manual_seed(0))
    print(f"zero-shot accuracy: {evaluate(model, DataLoader(test_set, batch_size=128), device):.3f}")
    model = finetune_subject(model, DataLoader(cal_set, batch_size=16, shuffle=True), args.target_subject, device)
    acc = evaluate(model, DataLoader(test_set, batch_size=128), device, subject=args.target_subject)
    print(f"calibrated accuracy: {acc:.3f}")
    torch.save(model.state_dict(), f"fbcnet_A{args.target_subject + 1:02d}.pt")


if __name__ == "__main__":
    main()
