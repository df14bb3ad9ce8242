"""EXPECT: AMP101,AMP112
FAULT: DLRM-style click model, fp16 autocast + GradScaler("cpu"). At step 12 (0-based; the 13th
batch) the feature pipeline forgets the log1p transform of the 13 dense count features, so the
bottom MLP's output (still finite, ~1e3) reaches the pairwise-interaction module `interaction`
(class DotInteraction) and its torch.bmm (line marked "# <- overflow") produces inf in fp16
(16-dim dot products of values ~1e3 > 65504). The logits and the loss become NaN/inf:
AMP112 at `scaler.scale(loss).backward()` (step 12), GradScaler skips the step, the guard
replays it (trace="auto") and AMP101 names the op torch.bmm in module `interaction`, source
line = the bmm line in DotInteraction.forward, step 12. Only that one batch is bad.
MAY: AMP109 (one skipped step among the first 13; 1 in a 100-step window is not > 1%)
"""
import json

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_DENSE, N_SPARSE, VOCAB, DIM = 13, 6, 500, 16
BAD_STEP = 12


class DotInteraction(nn.Module):
    def forward(self, dense, sparse):
        feats = torch.cat([dense.unsqueeze(1), sparse], dim=1)         # (B, 1+S, D)
        inter = torch.bmm(feats, feats.transpose(1, 2))                # <- overflow
        i, j = torch.triu_indices(feats.size(1), feats.size(1), offset=0)   # self-interaction kept
        return torch.cat([dense, inter[:, i, j]], dim=1)


class DLRM(nn.Module):
    def __init__(self):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(N_DENSE, 32), nn.ReLU(), nn.Linear(32, DIM), nn.ReLU())
        self.tables = nn.ModuleList(nn.Embedding(VOCAB, DIM) for _ in range(N_SPARSE))
        for t in self.tables:
            nn.init.uniform_(t.weight, -0.1, 0.1)
        self.interaction = DotInteraction()
        n_pairs = (N_SPARSE + 1) * (N_SPARSE + 2) // 2
        self.top = nn.Sequential(nn.Linear(DIM + n_pairs, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense, sparse_ids):
        d = self.bottom(dense)
        s = torch.stack([t(sparse_ids[:, k]) for k, t in enumerate(self.tables)], dim=1)
        return self.top(self.interaction(d, s)).squeeze(-1)


def make_batch(step, batch=128):
    g = torch.Generator().manual_seed(1000 + step)
    counts = torch.poisson(torch.rand(batch, N_DENSE, generator=g) * 3000, generator=g)
    ids = torch.randint(0, VOCAB, (batch, N_SPARSE), generator=g)
    clicks = (torch.rand(batch, generator=g) < 0.25).float()
    dense = counts if step == BAD_STEP else torch.log1p(counts) / 8.0   # the fault: one raw batch
    return dense, ids, clicks


model = DLRM()
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.02)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(40):
        dense, ids, clicks = make_batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(dense, ids)
            loss = F.binary_cross_entropy_with_logits(logits, clicks)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
