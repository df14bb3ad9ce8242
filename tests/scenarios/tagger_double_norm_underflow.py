"""EXPECT: AMP106
FAULT: the per-token loss of an fp16 sequence tagger is normalised twice and the
GradScaler was started at a tiny scale. `F.cross_entropy` already averages over the
2048 tokens of a batch, and `train_step` divides the result by `n_tokens` again
(copied from a version that used reduction="sum"), so every gradient is ~2048x too
small. The GradScaler was created with `init_scale=2.0` ("the default 65536 skipped
the first steps"); no step overflows and the default growth_interval=2000 never lets
it grow within these 100 steps, so the scale stays 2. At scale 2 the fp16 backward of
the MLP produces scaled weight gradients of order 1e-7, right at fp16's smallest
subnormal (2^-24 = 5.96e-8). Measured without the guard, at every step: about 19-23 % of
`mlp.fc1.weight`'s nonzero gradients sit in the 2^-24 bin (an estimated ~9-10 %
flushed, the flushed values bounding ~4-5 % of the layer's norm; an fp32 reference
backward of the same step has ~6 % of fc1's and ~4.6 % of fc2's gradients below
2^-25), i.e. far beyond the 1 % / 0.1 % limits, so AMP106 must be reported (at least
for `mlp.fc1`). The total unscaled gradient norm stays ~2.3e-4 (far above 1e-6) and
every layer's largest gradient stays above 1.5e-7 (far above 1e-10), so this is not
AMP105; no step overflows and the scale never falls, so no scaler codes. The loss
stays at ~2.97 (worse than the 2.83 of a uniform guess) for the whole run: plain SGD
gets nothing out of gradients this small.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB = 2000
N_TAGS = 17
D_MODEL = 128
D_HIDDEN = 256
BATCH, SEQ = 32, 64
STEPS = 100


class MLPBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class TokenTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.mlp = MLPBlock(D_MODEL, D_HIDDEN)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, N_TAGS)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def batches(seed=0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        # tag is a deterministic function of the token, with a little label noise
        tags = (tokens * 7 + 3) % N_TAGS
        noise = torch.rand(BATCH, SEQ, generator=gen) < 0.05
        tags = torch.where(noise, torch.randint(0, N_TAGS, (BATCH, SEQ), generator=gen), tags)
        yield tokens, tags


model = TokenTagger()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0)  # "65536 skipped the first steps"
data = batches()


def train_step(tokens, tags):
    n_tokens = tags.numel()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().view(-1, N_TAGS), tags.view(-1))
        loss = loss / n_tokens  # BUG: cross_entropy already averaged over the tokens
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item() * n_tokens


with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        tokens, tags = next(data)
        ce = train_step(tokens, tags)
        if step % 20 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  ce {ce:.4f}  scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
