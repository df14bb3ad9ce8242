"""EXPECT: none
FAULT: none (healthy control). An fp16 neural matrix-factorisation recommender with
two large id tables: a 20,000x32 user table with ordinary dense gradients and a
50,000x32 item table with `sparse=True` gradients trained by SparseAdam, next to Adam
for the dense part; one GradScaler (default scale 65536) drives both optimizers
(`scaler.step(opt_sparse); scaler.step(opt_dense); scaler.update()`, one training step
per iteration). It looks dangerous: each batch of 512 touches <=128 users and <=512
items, so >99 % of the user table's gradient is exact zeros and the item table's
gradient is a sparse tensor holding only the touched rows; ReLU units add more exact
zeros. Per the AMP105/AMP106 pages and REAL_WORLD_IDIOMS, exact zeros are sparsity,
not vanishing or underflow, and a layer is vanishing only when its largest gradient is
below 1e-10. Measured without the guard: no skipped step (scale stays 65536), every
parameter's largest unscaled gradient is above 6e-6, the total unscaled norm over both
optimizers is 0.05-0.28, at most 0.01 % of any scaled weight gradient sits in fp16's
2^-24 bin, and the BCE falls from 0.692 to 0.499. No code applies.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_USERS = 20_000
N_ITEMS = 50_000
DIM = 32
BATCH = 512
NEG_PER_POS = 3
STEPS = 100


class NeuralMF(nn.Module):
    """Neural matrix factorisation: big id tables, a small interaction MLP."""

    def __init__(self):
        super().__init__()
        self.user_emb = nn.Embedding(N_USERS, DIM)               # dense grads, mostly zero rows
        self.item_emb = nn.Embedding(N_ITEMS, DIM, sparse=True)  # sparse grads -> SparseAdam
        nn.init.normal_(self.user_emb.weight, std=0.05)
        nn.init.normal_(self.item_emb.weight, std=0.05)
        self.mlp = nn.Sequential(
            nn.Linear(3 * DIM, 128), nn.ReLU(),
            nn.Linear(128, 64), nn.ReLU(),
            nn.Linear(64, 1),
        )

    def forward(self, users, items):
        u, i = self.user_emb(users), self.item_emb(items)
        return self.mlp(torch.cat([u, i, u * i], dim=-1)).squeeze(-1)


class Interactions:
    """Implicit feedback from a hidden low-rank taste model; popular items are clicked more."""

    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.user_taste = torch.randn(N_USERS, 8, generator=self.gen)
        self.item_taste = torch.randn(N_ITEMS, 8, generator=self.gen)
        popularity = torch.arange(1, N_ITEMS + 1, dtype=torch.float32).pow(-0.8)
        self.popularity = popularity / popularity.sum()

    def batch(self):
        n_pos = BATCH // (1 + NEG_PER_POS)
        users = torch.randint(0, N_USERS, (n_pos,), generator=self.gen)
        cand = torch.multinomial(self.popularity, n_pos * 4, replacement=True, generator=self.gen).view(n_pos, 4)
        affinity = (self.user_taste[users].unsqueeze(1) * self.item_taste[cand]).sum(-1)
        pos_items = cand.gather(1, affinity.argmax(dim=1, keepdim=True)).squeeze(1)
        neg_users = users.repeat_interleave(NEG_PER_POS)
        neg_items = torch.randint(0, N_ITEMS, (n_pos * NEG_PER_POS,), generator=self.gen)
        all_users = torch.cat([users, neg_users])
        all_items = torch.cat([pos_items, neg_items])
        labels = torch.cat([torch.ones(n_pos), torch.zeros(n_pos * NEG_PER_POS)])
        return all_users, all_items, labels


data = Interactions()
model = NeuralMF()
sparse_params = [model.item_emb.weight]
dense_params = [p for n, p in model.named_parameters() if not n.startswith("item_emb")]
opt_sparse = torch.optim.SparseAdam(sparse_params, lr=1e-2)
opt_dense = torch.optim.Adam(dense_params, lr=1e-3)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        users, items, labels = data.batch()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(users, items)
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        opt_sparse.zero_grad(set_to_none=True)
        opt_dense.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt_sparse)
        scaler.step(opt_dense)
        scaler.update()
        if step % 20 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  bce {loss.item():.4f}  scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
