"""EXPECT: AMP001
MAY: AMP004,AMP110

FAULT: fine-tuning a (randomly initialised stand-in for a) pretrained text encoder with a
new classification head under bf16 CPU autocast, AdamW, no GradScaler. To "halve the
memory of the big encoder", `setup_model()` casts the trainable encoder by hand:
`model.encoder.to(torch.bfloat16)` while grad mode is on and its parameters require
grad, and the optimizer is then built over all parameters, so the encoder trains in pure
bf16 (bf16 weights, bf16 gradients, bf16 Adam state): updates smaller than ~1/256 of a
weight are rounded away. The cast happens inside the guarded `train()` before the first
optimizer step (step 0 or None), at the line `model.encoder.to(torch.bfloat16)` in
`setup_model`, module `encoder`: AMP001 at run time. The run is otherwise healthy and
finite (unscaled gradient norm 1-3, no reduction written in low precision by the user:
the [CLS] token is pooled, not a mean). Consequences of the cast that the docs leave open:
torch's own `clip_grad_norm_` takes `_foreach_norm` over the now-bf16 encoder gradients
(bf16 in, bf16 out: AMP004 left open), and absorbed bf16 updates/adds are only visible
with per-op checks (AMP110 left open). 30 optimizer steps.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
VOCAB, D, HEADS, LAYERS, T, N_LABELS = 1000, 64, 4, 3, 24, 3


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, pad_mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        attn_mask = ~pad_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, D))
        return x + self.ff(self.ln2(x))


class TextEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D, padding_idx=0)
        self.pos = nn.Embedding(T, D)
        self.layers = nn.ModuleList([EncoderLayer() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(D)

    def forward(self, ids):
        pad_mask = ids == 0
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1)))
        for layer in self.layers:
            x = layer(x, pad_mask)
        return self.ln(x)


class SequenceClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = TextEncoder()
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(D, N_LABELS)

    def forward(self, ids):
        h = self.encoder(ids)
        return self.classifier(self.dropout(h[:, 0]))       # [CLS] pooling


def setup_model():
    model = SequenceClassifier()
    model.encoder.to(torch.bfloat16)                # save memory: the encoder is the big part
    return model


def make_batch(g, n=32):
    labels = torch.randint(0, N_LABELS, (n,), generator=g)
    ids = torch.randint(4, VOCAB, (n, T), generator=g)
    ids[:, 0] = 1                                                   # [CLS]
    ids[:, 1:4] = (labels * 100 + 10).view(-1, 1) + torch.randint(0, 50, (n, 3), generator=g)
    lengths = torch.randint(T // 2, T + 1, (n,), generator=g)
    ids[torch.arange(T).view(1, -1) >= lengths.view(-1, 1)] = 0     # padding
    return ids, labels


def train():
    g = torch.Generator().manual_seed(1)
    model = setup_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    model.train()
    for step in range(30):
        ids, labels = make_batch(g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if DEBUG:
            print(f"step {step} loss {loss.item():.4f} norm {norm.item():.3f}", file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
