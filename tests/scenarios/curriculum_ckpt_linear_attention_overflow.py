"""EXPECT: AMP101 AMP107 AMP108 AMP112
MAY: AMP102 AMP104

FAULT: a post-LN linear-attention forecaster trained with fp16 autocast, a GradScaler,
activation checkpointing (use_reentrant=False) and a sequence-length curriculum (10 steps
at 256 tokens, then 30 at 4096). LinearAttention contracts phi(K)^T V, the numerator and
the normaliser with torch.einsum under autocast, i.e. in fp16, and those sums grow
linearly with the sequence length: at 256 tokens the largest fp16 value is ~1.4e4, at
4096 tokens the einsum outputs in blocks.0.attn pass 65504 and hold inf (from finite
inputs), and the loss is NaN at every step of the long phase (checked without the guard:
loss NaN at steps 10-39, finite at 0-9).
- AMP112 (nonfinite-loss page): the loss is NaN when backward starts, steps 10-39.
- AMP101 (nonfinite-forward page): on the CPU a non-finite loss is judged before the
  optimizer would apply the step, so the replay of the model's forward (the overflow is
  inside the root module, not in a loose loss function) names the einsum in blocks.0.attn.
- AMP107 (loss-scale-collapse page): GradScaler skips every long step and halves the
  scale 30 times in a row, 16384 -> 2**-16; it is <= 1 from step 23 on and never rises.
- AMP108 (loss-scale-decline page): 30 consecutive decreases after steps went through
  (8 of the 10 short steps did); the scale also falls below 65536/100 and below 128 while
  still falling.
The short phase itself is ordinary: the scaler settles twice (skips at steps 0 and 7,
65536 -> 16384, head.weight's scaled gradient overflowing), raw gradient norm 3.9-7.3,
clipped to 1.
MAY: AMP102 (per-op checks after the anomaly see fp16 einsum outputs at 65504, i.e. above
60000, next to the ones that overflow); AMP104 (the pages do not say whether a step the
scaler skipped, whose gradients are inf/NaN, has its norm judged; the applied norm is
clipped to 1).
Not expected: AMP103 (the scaler catches every non-finite gradient), AMP109 (40 steps:
its 100-step window is never full), code-pattern rules (phi(K).sum runs in fp32, the
loss takes .float() inside autocast, unscale_ before clipping, backward outside autocast).
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

CHANNELS, D_MODEL, HEADS, DEPTH, MAX_LEN = 8, 64, 4, 2, 4096
CURRICULUM = [(256, 8, 10), (4096, 2, 30)]  # (seq_len, batch, steps)


class LinearAttention(nn.Module):
    """Katharopoulos et al. linear attention, non-causal, elu+1 feature map."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.dh).unbind(2)
        q = F.elu(q.float()) + 1.0
        k = F.elu(k.float()) + 1.0
        kv = torch.einsum("bnhd,bnhe->bhde", k, v)               # sum over all n tokens
        num = torch.einsum("bnhd,bhde->bnhe", q, kv)
        den = torch.einsum("bnhd,bhd->bnh", q, k.sum(dim=1))
        out = num / den.unsqueeze(-1)
        return self.proj(out.reshape(b, n, d))


class Block(nn.Module):
    """Post-LN block, the nn.TransformerEncoderLayer default (norm_first=False)."""

    def __init__(self, d, heads):
        super().__init__()
        self.attn = LinearAttention(d, heads)
        self.norm1 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm2 = nn.LayerNorm(d)

    def forward(self, x):
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(CHANNELS, D_MODEL)
        self.pos = nn.Embedding(MAX_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL, HEADS) for _ in range(DEPTH))
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, feats):
        n = feats.shape[1]
        x = self.inp(feats) + self.pos(torch.arange(n))
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return self.head(x).squeeze(-1)


def sensor_batch(seq_len, batch, gen):
    """Standardised multichannel sensor windows: a per-window level, a slow oscillation
    and noise; the target is channel 0 one step ahead."""
    t = torch.arange(seq_len + 1).float()
    level = torch.randn(batch, 1, CHANNELS, generator=gen)
    freq = torch.rand(batch, 1, CHANNELS, generator=gen) * 0.2 + 0.02
    phase = torch.rand(batch, 1, CHANNELS, generator=gen) * 2 * math.pi
    x = level + 0.5 * torch.sin(t[None, :, None] * freq + phase)
    x = x + 0.1 * torch.randn(batch, seq_len + 1, CHANNELS, generator=gen)
    return x[:, :-1], x[:, 1:, 0]


model = Forecaster()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(1)

with amp_runtime.guard(policy="record", model=model) as g:
    step = 0
    for seq_len, batch, steps in CURRICULUM:
        for _ in range(steps):
            feats, target = sensor_batch(seq_len, batch, gen)
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(feats)
                loss = F.mse_loss(pred.float(), target)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step % 10 == 0:
                print(f"step {step} len {seq_len} loss {loss.item():.4f} scale {scaler.get_scale():g}")
            step += 1

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
