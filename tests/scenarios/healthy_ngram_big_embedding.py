"""EXPECT: none
FAULT: none (healthy control). Neural 4-gram language model (shortlist softmax over the 512 most
frequent words) with a big token embedding (8000 x 48) trained in fp16 autocast + GradScaler("cpu") (default scale 65536, no skipped step),
AdamW + OneCycleLR, gradient accumulation over 2 micro-batches, `scaler.unscale_(optimizer)`
before `clip_grad_norm_`, an evaluation loop under `torch.no_grad()` (also under autocast) every
10 steps. Tricky-but-healthy parts: each step only ~380-435 of the 8000 embedding rows appear in the
batch, so ~95% of `embed.weight`'s gradient rows are exactly zero (sparsity, not underflow:
AMP106 counts no exact zeros, and the layer's max |grad| is far above 1e-10, so no AMP105); a
quarter of the hidden ReLU units are dead by construction (bias -30), so their rows of `hidden`
and columns of `out` get exactly zero gradient every step. The loss is computed inside autocast
(cross_entropy runs in fp32 there), backward outside it.
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, SHORTLIST, CTX, EMB, HID = 8000, 512, 3, 48, 256


class NGramLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMB)
        self.hidden = nn.Linear(CTX * EMB, HID)
        self.out = nn.Linear(HID, SHORTLIST)        # shortlist softmax over frequent words
        with torch.no_grad():
            self.hidden.bias[: HID // 4] = -30.0          # dead ReLU units

    def forward(self, context):
        e = self.embed(context).flatten(1)
        return self.out(F.relu(self.hidden(e)))


def zipf_tokens(n, g):
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float)
    return torch.multinomial(1.0 / ranks, n, replacement=True, generator=g)


def make_batch(seed, batch=128):
    g = torch.Generator().manual_seed(seed)
    ctx = zipf_tokens(batch * CTX, g).view(batch, CTX)
    target = (ctx[:, 0] * 7 + ctx[:, 2]) % SHORTLIST           # a learnable rule
    return ctx, target


model = NGramLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
STEPS, ACCUM = 40, 2
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=STEPS)
scaler = torch.amp.GradScaler("cpu")
val = [make_batch(10_000 + i) for i in range(2)]
history = []

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        model.train()
        for micro in range(ACCUM):
            ctx, target = make_batch(step * ACCUM + micro)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(ctx), target) / ACCUM
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        if step % 10 == 9:
            model.eval()
            val_loss = 0.0
            with torch.no_grad():
                for ctx, target in val:
                    with torch.autocast("cpu", dtype=torch.float16):
                        val_loss += F.cross_entropy(model(ctx), target).item() / len(val)
            history.append(val_loss)

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
