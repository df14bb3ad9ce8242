"""EXPECT: none

FAULT: none (healthy control). A 4-layer pre-LayerNorm transformer token tagger trained
with fp16 CPU autocast and a GradScaler, where every block runs under
`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` (activation
checkpointing: the block's forward is recomputed inside the backward, under the autocast
state recorded at the forward). The recomputed forward runs while backward is in
progress but autocast is off at the user's `backward()` call (the checkpoint restores
autocast itself), so this is not a backward under autocast; the loss is computed inside
the region, the scaler is used correctly (unscale_ before clip, step, update), the loss
scale never backs off, and gradients stay in a normal range. 30 optimizer steps.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
VOCAB, N_TAGS, D, HEADS, LAYERS, T, B = 512, 9, 64, 4, 4, 32, 16


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Tagger(nn.Module):
    def __init__(self, grad_checkpointing=True):
        super().__init__()
        self.grad_checkpointing = grad_checkpointing
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(1, T, D) * 0.02)
        self.blocks = nn.ModuleList([Block(D, HEADS) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, N_TAGS)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.size(1)]
        for block in self.blocks:
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def make_batch(g):
    idx = torch.randint(0, VOCAB, (B, T), generator=g)
    # tag = a function of the token and its left neighbour (needs context)
    prev = torch.roll(idx, 1, dims=1)
    tags = (idx * 7 + prev * 3) % N_TAGS
    return idx, tags


def train():
    g = torch.Generator().manual_seed(1)
    model = Tagger(grad_checkpointing=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu")
    model.train()
    for step in range(30):
        idx, tags = make_batch(g)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx)
            loss = F.cross_entropy(logits.view(-1, N_TAGS), tags.view(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        if DEBUG:
            print(f"step {step} loss {loss.item():.4f} norm {norm.item():.3f} scale {scaler.get_scale()}",
                  file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
