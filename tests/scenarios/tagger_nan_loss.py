"""EXPECT: AMP101,AMP103,AMP112
FAULT: token tagger (embedding + 2 pre-norm MLP blocks), bf16 autocast, no GradScaler, AdamW +
cosine LR. The model computes its own loss (HF/nanoGPT style, returns (logits, loss)) as a
masked mean: sum(nll * weight) / sum(weight), where weight marks the word-initial tokens. At
step 18 (0-based) the loader yields a batch in which no token is word-initial (weights all 0),
so the masked mean is 0/0 = NaN: AMP112 at `loss.backward()` (step 18). Its backward makes every
gradient NaN and, with no GradScaler, AdamW steps on them: AMP103 at step 18 (parameters of all
layers). The replay of step 18 (trace="auto", before the optimizer applies it) names the first
non-finite op as AMP101: the division (torch.Tensor.div / __truediv__) in the root module
(TokenTagger.forward, line marked "# <- 0/0"), step 18. From step 19 on the weights are NaN
and the loss stays NaN (AMP112/AMP103 repeat; no new AMP101, the NaN only propagates).
MAY: AMP104/AMP105 if the guard judges NaN norms as out of range (docs do not say it does)
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, TAGS, DIM, SEQ, BATCH = 800, 9, 64, 24, 16
BAD_STEP = 18


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TokenTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, TAGS)

    def forward(self, tokens, tags=None, weight=None):
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if tags is None:
            return logits, None
        nll = F.cross_entropy(logits.flatten(0, 1), tags.flatten(), reduction="none")
        loss = (nll * weight.flatten()).sum() / weight.sum()          # <- 0/0
        return logits, loss


def make_batch(step):
    g = torch.Generator().manual_seed(7 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tags = (tokens % TAGS + torch.randint(0, 2, (BATCH, SEQ), generator=g)) % TAGS
    word_initial = (torch.rand(BATCH, SEQ, generator=g) < 0.6).float()
    if step == BAD_STEP:
        word_initial.zero_()                        # the fault: a batch with no word-initial token
    return tokens, tags, word_initial


model = TokenTagger()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
steps = 30
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(steps):
        tokens, tags, weight = make_batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(tokens, tags, weight)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
