"""EXPECT: none
HEALTHY: token tagger (vocabulary 4000 with Zipf-distributed tokens, padding, half of
the tokens unlabelled with ignore_index=-100), fp16 autocast with a GradScaler, AdamW,
96 steps. Most gradients are EXACT zeros by design: ~98% of `emb.weight` (rows of tokens
absent from the batch, and the padding row), 50% of `fc1` (a block of 128 ReLU units
loaded dead from an earlier run: bias -4, they never fire) and ~51% of `fc2.weight`
(the columns fed by those dead units); masked positions give zero logit gradients.
Every parameter still has nonzero gradients (checked with plain torch, no guard, at
steps 0/32/64: per-parameter max |grad| 2.4e-3 to 0.12, no nonzero scaled gradient at
fp16's 2^-24 floor, <0.01% subnormal, the scaler never skips, loss 2.20 -> 1.04).
Why no code (from the pages): AMP106 page: "Exact zeros never count: an embedding row
whose token is not in the batch, a dead ReLU unit, a masked position have exactly zero
gradients by design, which is sparsity, not underflow" (its check runs at steps 0/32/64);
AMP105 needs a layer whose *largest* gradient is < 1e-10 or a total norm < 1e-6, and
every layer has a nonzero max; REAL_WORLD_IDIOMS: "Zero is not underflow". The loss is
inside autocast (cross_entropy runs in fp32 on CPU), no scaler misuse, nothing
non-finite.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

V, D, TAGS, T, B = 4000, 64, 9, 32, 16


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.fc1 = nn.Linear(D, 256)
        self.fc2 = nn.Linear(256, 128)
        self.head = nn.Linear(128, TAGS)

    def forward(self, tokens):
        h = F.relu(self.fc1(self.emb(tokens)))
        return self.head(F.relu(self.fc2(h)))


model = Tagger()
with torch.no_grad():
    model.fc1.bias[:128] = -4.0     # as loaded: half of fc1's units died in an earlier LR spike

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
zipf = 1.0 / torch.arange(1, V).float() ** 1.1


def batch():
    tokens = torch.multinomial(zipf, B * T, replacement=True).view(B, T) + 1
    lengths = torch.randint(8, T + 1, (B,))
    pad = torch.arange(T)[None] >= lengths[:, None]
    tokens[pad] = 0
    tags = (tokens % TAGS).clone()
    tags[pad] = -100
    tags[torch.rand(B, T) < 0.5] = -100        # only half of the tokens are annotated
    return tokens, tags


with amp_runtime.guard(policy="record") as g:
    for step in range(96):
        tokens, tags = batch()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
            loss = F.cross_entropy(logits.view(-1, TAGS), tags.view(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 32 == 0:
            print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
