"""Streaming keyword spotting on Speech Commands v2 (12-class task).

Causal depthwise TCN + chunked self-attention, so the model can run frame by
frame on device with a bounded left context. SpecAugment on log-mels.
"""
import argparse
import copy
import math
import os
import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader, Dataset

KEYWORDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]
LABELS = ["_silence_", "_unknown_"] + KEYWORDS


@dataclass
class KWSConfig:
    root: str = "/data/speech_commands_v2"
    sample_rate: int = 16000
    n_mels: int = 40
    win_ms: float = 25.0
    hop_ms: float = 10.0
    channels: int = 96
    blocks: int = 6
    heads: int = 4
    left_chunks: int = 4
    chunk_frames: int = 8
    epochs: int = 40
    batch_size: int = 256
    lr: float = 2e-3
    label_smoothing: float = 0.1
    clip: float = 5.0
    amp: bool = True


class SpeechCommands(Dataset):
    def __init__(self, cfg: KWSConfig, split: str):
        self.cfg = cfg
        with open(os.path.join(cfg.root, f"{split}_list.txt")) as f:
            self.items = [line.strip() for line in f if line.strip()]
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=cfg.sample_rate, n_fft=512,
            win_length=int(cfg.sample_rate * cfg.win_ms / 1000),
            hop_length=int(cfg.sample_rate * cfg.hop_ms / 1000), n_mels=cfg.n_mels)
        self.train = split == "train"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel = self.items[i]
        word = rel.split("/")[0]
        label = LABELS.index(word) if word in KEYWORDS else (0 if word == "_silence_" else 1)
        wav, sr = torchaudio.load(os.path.join(self.cfg.root, rel))
        wav = wav[0, : self.cfg.sample_rate]
        wav = F.pad(wav, (0, self.cfg.sample_rate - wav.numel()))
        if self.train:
            shift = random.randint(-1600, 1600)
            wav = torch.roll(wav, shift)
            wav = wav * random.uniform(0.8, 1.2)
        feats = torch.log(self.mel(wav) + 1e-6)
        return feats, label


class SpecAugment(nn.Module):
    def __init__(self, freq_masks=2, freq_width=8, time_masks=2, time_width=20):
        super().__init__()
        self.freq_masks, self.freq_width = freq_masks, freq_width
        self.time_masks, self.time_width = time_masks, time_width

    @torch.no_grad()
    def forward(self, spec):
        spec = spec.clone()
        fill = spec.mean()
        n_mels, n_frames = spec.shape[-2:]
        for b in range(spec.size(0)):
            for _ in range(self.freq_masks):
                f = random.randint(0, self.freq_width)
                f0 = random.randint(0, n_mels - f)
                spec[b, f0:f0 + f, :] = fill
            for _ in range(self.time_masks):
                t = random.randint(0, self.time_width)
                t0 = random.randint(0, n_frames - t)
                spec[b, :, t0:t0 + t] = fill
        return spec


class CausalTCNBlock(nn.Module):
    def __init__(self, channels, kernel=5, dilation=1):
        super().__init__()
        self.pad = (kernel - 1) * dilation
        self.dw = nn.Conv1d(channels, channels, kernel, dilation=dilation, groups=channels)
        self.pw = nn.Conv1d(channels, channels, 1)
        self.norm = nn.BatchNorm1d(channels)

    def forward(self, x):
        y = self.dw(F.pad(x, (self.pad, 0)))
        y = self.norm(self.pw(F.relu(y)))
        return F.relu(x + y)


class ChunkedSelfAttention(nn.Module):
    """Each frame attends to its own chunk and `left_chunks` chunks before it."""

    def __init__(self, dim, heads, chunk, left_chunks):
        super().__init__()
        self.heads, self.chunk, self.left = heads, chunk, left_chunks
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.scale = (dim // heads) ** -0.5

    def streaming_mask(self, length, device):
        chunk_id = torch.arange(length, device=device) // self.chunk
        diff = chunk_id.unsqueeze(1) - chunk_id.unsqueeze(0)
        return (diff >= 0) & (diff <= self.left)

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) * self.scale
        allowed = self.streaming_mask(t, x.device)
        scores = torch.where(allowed, scores, torch.tensor(-1e9, device=x.device))  # expect: AMP007
        attn = scores.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(out)


class StatsPool(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=-1)  # expect: AMP004
        std = torch.sqrt(x.var(dim=-1, unbiased=False) + 1e-10)  # expect: AMP004 AMP011
        return torch.cat([mean, std], dim=-1)


class StreamingKWS(nn.Module):
    def __init__(self, cfg: KWSConfig, num_classes=len(LABELS)):
        super().__init__()
        c = cfg.channels
        self.stem = nn.Conv1d(cfg.n_mels, c, 3, padding=0)
        self.blocks = nn.ModuleList([CausalTCNBlock(c, 5, 2 ** (i % 3)) for i in range(cfg.blocks)])
        self.attn = ChunkedSelfAttention(c, cfg.heads, cfg.chunk_frames, cfg.left_chunks)
        self.attn_norm = nn.LayerNorm(c)
        self.head_conv = nn.Conv1d(c, 2 * c, 1)
        self.pool = StatsPool()
        self.classifier = nn.Linear(4 * c, num_classes)

    def forward(self, feats):
        x = self.stem(F.pad(feats, (2, 0)))
        for blk in self.blocks:
            x = blk(x)
        h = x.transpose(1, 2)
        h = h + self.attn(self.attn_norm(h))
        pooled = self.pool(self.head_conv(h.transpose(1, 2)))
        return self.classifier(pooled)


def train_epoch(model, loader, optimizer, scheduler, scaler, specaug, cfg, device):
    model.train()
    total, correct, loss_sum = 0, 0, 0.0
    for feats, labels in loader:
        feats = specaug(feats.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        with torch.cuda.amp.autocast(enabled=cfg.amp, dtype=torch.float16):  # expect: AMP009
            logits = model(feats)
            loss = F.cross_entropy(logits, labels, label_smoothing=cfg.label_smoothing)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss_sum += loss.item() * labels.size(0)
        correct += (logits.argmax(-1) == labels).sum().item()
        total += labels.size(0)
    return loss_sum / total, correct / total


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, false_accepts, negatives = 0, 0, 0, 0
    for feats, labels in loader:
        feats, labels = feats.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(feats)
        pred = logits.float().argmax(-1)
        correct += (pred == labels).sum().item()
        total += labels.numel()
        neg = labels < 2
        false_accepts += (neg & (pred >= 2)).sum().item()
        negatives += neg.sum().item()
    return correct / total, false_accepts / max(negatives, 1)


def export_streaming(model, cfg, path):
    m = copy.deepcopy(model).eval().half()
    example = torch.randn(1, cfg.n_mels, 100, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        traced = torch.jit.trace(m, example)
    traced.save(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=KWSConfig.root)
    parser.add_argument("--epochs", type=int, default=KWSConfig.epochs)
    parser.add_argument("--out", default="runs/kws")
    args = parser.parse_args()
    cfg = KWSConfig(root=args.root, epochs=args.epochs)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    train_loader = DataLoader(SpeechCommands(cfg, "train"), batch_size=cfg.batch_size, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(SpeechCommands(cfg, "validation"), batch_size=512, num_workers=8)

    model = StreamingKWS(cfg).to(device)
    specaug = SpecAugment().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    steps = cfg.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / 1000) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)

    best_acc = 0.0
    for epoch in range(cfg.epochs):
        tr_loss, tr_acc = train_epoch(model, train_loader, optimizer, scheduler, scaler, specaug, cfg, device)
        va_acc, va_far = evaluate(model, val_loader, device)
        print(f"epoch {epoch:02d} loss {tr_loss:.4f} train_acc {tr_acc:.4f} val_acc {va_acc:.4f} FAR {va_far:.4f}")
        if va_acc > best_acc:
            best_acc = va_acc
            torch.save({"model": model.state_dict(), "cfg": cfg.__dict__, "epoch": epoch},
                       os.path.join(args.out, "best.pt"))
    export_streaming(model, cfg, os.path.join(args.out, "kws_stream.ts"))


if __name__ == "__main__":
    main()
