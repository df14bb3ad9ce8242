"""EXPECT: AMP007,AMP101,AMP112
MAY: AMP102,AMP110

FAULT: a one-layer attention classifier builds its additive key-padding bias in the
dtype of the scores with the fp32 sentinel, module ``attn`` (PaddedAttention), line 51:
``bias = torch.where(keep, torch.zeros_like(scores), torch.finfo(torch.float32).min)``.
Under fp16 autocast ``scores`` (q @ k^T) is fp16, so -3.4e38 becomes -inf in every
step. Rows with at least one real token still softmax to finite weights, but the
data set contains empty transcripts (length 0, all padding) in steps 7 and 16: that
sample's score rows are all -inf, softmax gives NaN, the pooled features, logits and
the batch loss are NaN. GradScaler skips those two steps (2 decreases only).

Pages: AMP007 runtime "the guard reports such a constant meeting an fp16 tensor (the
result holds inf)", and the branches of ``torch.where`` are listed among the fills
(every step, seen on watched steps). AMP112 "the loss is NaN or Inf when backward
starts" (steps 7 and 16). AMP101: the NaN step is replayed under trace="auto" (the
model is a root module, CPU: before the optimizer step) and per-op checks stay on for
a while; the first op whose output holds -inf while its inputs were finite is the
``torch.where`` fill (softmax's input already holds -inf).
MAY: AMP102 ("an fp16 output with |x| > 60000") - the page does not say whether an
infinite output counts; AMP110 - ``scores + bias`` adds 0 / -inf to the scores while
per-op checks are on, and the page does not say how an infinite operand is judged.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, DIM, MAXLEN, CLASSES = 200, 32, 24, 4


class PaddedAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, keep):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        keep = keep[:, None, :]                                   # (B, 1, T) key padding
        bias = torch.where(keep, torch.zeros_like(scores), torch.finfo(torch.float32).min)
        weights = (scores + bias).softmax(dim=-1)
        return self.out(weights @ v)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(MAXLEN, DIM) * 0.02)
        self.attn = PaddedAttention(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens, keep):
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        x = x + self.attn(x, keep)
        m = keep.float()[..., None]
        pooled = (x.float() * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(pooled)


def make_batch(step, batch_size=16):
    lengths = torch.randint(4, MAXLEN + 1, (batch_size,))
    if step in (7, 16):
        lengths[3] = 0                                            # an empty transcript
    keep = torch.arange(MAXLEN)[None, :] < lengths[:, None]
    tokens = torch.randint(1, VOCAB, (batch_size, MAXLEN)) * keep
    labels = torch.randint(0, CLASSES, (batch_size,))
    return tokens, keep, labels


model = Classifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(24):
        tokens, keep, labels = make_batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens, keep)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:2d} loss {loss.item():.4f} scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
