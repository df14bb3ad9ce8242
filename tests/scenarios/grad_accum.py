"""EXPECT: none

FAULT: none (healthy control). A small 1-D CNN audio-tagging model trained with fp16 CPU
autocast and a GradScaler using gradient accumulation in the usual recipe: every
micro-batch is scaled and backpropagated (`scaler.scale(loss / accum).backward()`), the
next micro-batch is fetched between forward and backward, and only every 4th micro-batch
runs `scaler.unscale_(opt)`, `clip_grad_norm_`, `scaler.step`, `scaler.update` and
`zero_grad`. The loss scale never has to back off (no skipped steps), the unscaled total
gradient norm stays below 100 and above 1e-6, clipping runs after unscale_, losses are
computed inside the autocast region (cross_entropy runs in fp32 there) and no fp16
reduction is written by hand. 24 optimizer steps = 96 micro-batches.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
N_CLASSES = 10
ACCUM = 4
STEPS = 24
MICRO_BATCH = 16


class AudioTagger(nn.Module):
    def __init__(self, n_mels=32, width=64, n_classes=N_CLASSES):
        super().__init__()
        self.stem = nn.Conv1d(n_mels, width, kernel_size=5, padding=2)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Conv1d(width, width, 3, padding=1), nn.GELU()) for _ in range(3)]
        )
        self.pool = nn.AdaptiveMaxPool1d(1)
        self.head = nn.Linear(width, n_classes)

    def forward(self, mel):
        h = F.gelu(self.stem(mel))
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.pool(h).flatten(1))


class SyntheticMelDataset(torch.utils.data.Dataset):
    """Log-mel-like features: a class-dependent band pattern plus noise."""

    def __init__(self, n=MICRO_BATCH * ACCUM * STEPS, n_mels=32, frames=48):
        g = torch.Generator().manual_seed(1)
        self.labels = torch.randint(0, N_CLASSES, (n,), generator=g)
        protos = 0.3 * torch.randn(N_CLASSES, n_mels, 1, generator=g)
        self.mels = protos[self.labels] + torch.randn(n, n_mels, frames, generator=g)
        flip = torch.rand(n, generator=g) < 0.2                      # 20% label noise
        self.labels[flip] = torch.randint(0, N_CLASSES, (int(flip.sum()),), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.mels[i], self.labels[i]


def train():
    model = AudioTagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    loader = torch.utils.data.DataLoader(SyntheticMelDataset(), batch_size=MICRO_BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    data_iter = iter(loader)
    mel, label = next(data_iter)
    model.train()
    for step in range(STEPS):
        for micro in range(ACCUM):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(mel)
                loss = F.cross_entropy(logits, label)
                loss = loss / ACCUM
            # prefetch the next micro-batch while the graph is alive (nanoGPT style)
            try:
                mel, label = next(data_iter)
            except StopIteration:
                data_iter = iter(loader)
                mel, label = next(data_iter)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        if DEBUG:
            tiny = min(p.grad.abs().max().item() for p in model.parameters())
            print(f"step {step} loss {loss.item() * ACCUM:.4f} grad_norm {grad_norm.item():.4f} "
                  f"scale {scaler.get_scale():.0f} min_layer_max {tiny:.2e}", file=sys.stderr)
        optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            break


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
