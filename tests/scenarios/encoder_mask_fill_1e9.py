"""EXPECT: AMP007
FAULT: 2-layer transformer encoder for sentence classification, fp16 autocast + GradScaler("cpu"),
AdamW + linear-warmup LambdaLR, gradient accumulation over 2 micro-batches, key-padding mask.
From step 0 on, the attention masks padded keys with a literal beyond fp16's range:
`torch.where(key_mask, scores, -1e9)` on the fp16 attention scores (line marked "# <- -1e9 fill"
in SelfAttention.forward, modules `layers.0.attn` and `layers.1.attn`); the fill silently
becomes -inf in fp16 (no error: torch.where, unlike masked_fill, does not raise). AMP007 at that
line, step 0 (every watched step). Every sequence keeps at least 4 real tokens, so no
attention row is entirely -inf: softmax stays finite, no NaN, no skipped step.
MAY: nothing else (per-op checks stay off: there is no step-level anomaly)
"""
import json
import math

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, DIM, HEADS, SEQ, CLASSES = 1000, 64, 4, 32, 4
PAD = 0


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, key_mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS)
        scores = torch.where(key_mask[:, None, None, :], scores, -1e9)   # <- -1e9 fill
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, DIM))


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SelfAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, key_mask):
        x = x + self.attn(self.ln1(x), key_mask)
        return x + self.mlp(self.ln2(x))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        key_mask = tokens != PAD
        x = self.embed(tokens) + self.pos(torch.arange(tokens.size(1)))
        for layer in self.layers:
            x = layer(x, key_mask)
        m = key_mask.unsqueeze(-1).float()
        pooled = (x.float() * m).sum(1) / m.sum(1)
        return self.head(pooled)


def make_batch(step, micro, batch=16):
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
    lengths = torch.randint(4, SEQ + 1, (batch,), generator=g)
    tokens[torch.arange(SEQ)[None, :] >= lengths[:, None]] = PAD
    labels = (tokens[:, 0] + tokens[:, 1]) % CLASSES
    return tokens, labels


model = Classifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
scaler = torch.amp.GradScaler("cpu")
ACCUM = 2

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(24):
        for micro in range(ACCUM):
            tokens, labels = make_batch(step, micro)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(tokens), labels) / ACCUM
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
