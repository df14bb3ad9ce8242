"""EXPECT: none

HEALTHY: a small transformer encoder classifier whose encoder layers run under bf16 CPU autocast
(no GradScaler, correct for bf16) while its head, `FP32Head` (module `head`), runs in an
`torch.autocast("cpu", enabled=False)` island: it upcasts what arrives (`h.float()`; the island
does not upcast by itself), mask-pools, LayerNorms and classifies in fp32, so the logits are
fp32 and `cross_entropy` (inside the region) gets fp32 input. Inside the encoder: LayerNorm,
`scores * (1/sqrt(d_head))` (the correct scale, 0.25), softmax and both matmuls in bf16; the
residual stream stays fp32 (token embedding + fp32 positional parameter, plus bf16 branch
outputs). AdamW, `clip_grad_norm_(1.0)` without a scaler, backward outside autocast. Plain torch,
no guard: loss 1.2 -> 1.0-1.1 over 40 steps, logits fp32, total grad norm 0.8-2.8, smallest
per-parameter max |grad| 2.4e-3, no NaN/Inf.

Why no event from the pages: AMP002 is "a loss function runs with autocast off on low-precision
inputs produced under autocast"; here the loss runs with autocast on, on fp32 logits. AMP004
needs a reduction "whose input and output are both fp16/bf16": the island's `sum`s run on fp32,
softmax and layer_norm are not reductions from its list. No hand cast of a module or grad tensor
(AMP001: `h.float()` is an upcast), no scaler (AMP010 flags "a scaler in use with bf16
autocast", not its absence), backward outside autocast (AMP008), clipping without a scaler
(AMP005), attention scores of magnitude ~1 (AMP102 is fp16 only anyway), grad norms between 1e-6
and 100 (AMP104/AMP105).
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

VOCAB, D, N_HEADS, SEQ, N_CLASSES = 50, 64, 4, 16, 3


class SelfAttention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d // n_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d_head))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), SelfAttention(d, n_heads)
        self.ln2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class FP32Head(nn.Module):
    """Pooling, norm and classifier kept in fp32: an autocast(enabled=False) island."""

    def __init__(self, d, n_classes):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, n_classes)

    def forward(self, h, mask):
        with torch.autocast("cpu", enabled=False):
            h = h.float()  # the island does not upcast what arrives in bf16
            m = mask.unsqueeze(-1).float()
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
            return self.fc(self.norm(pooled))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, D))
        self.layers = nn.ModuleList(EncoderLayer(D, N_HEADS) for _ in range(2))
        self.head = FP32Head(D, N_CLASSES)

    def forward(self, tokens, mask):
        h = self.tok(tokens) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h, mask)


def batch(gen, n=32):
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    lengths = torch.randint(4, SEQ + 1, (n,), generator=gen)
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    y = tokens[:, 0] % N_CLASSES  # the class is carried by the first token
    return tokens, mask, y


model = Classifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
gen = torch.Generator().manual_seed(1)

with amp_runtime.guard(policy="record") as g:
    for step in range(40):
        tokens, mask, y = batch(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens, mask)  # fp32: the head ran in its island
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == 39:
            print(f"step {step} loss {loss.item():.4f} logits dtype {logits.dtype}")

for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
