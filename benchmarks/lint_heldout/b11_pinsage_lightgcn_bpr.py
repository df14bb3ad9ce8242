"""LightGCN propagation + PinSage-style neighbour attention + MLP scorer, BPR loss.

Item table is ~9M rows (the full catalogue), user table ~2M. Trained on the
click log sampled into (u, i+, i-) triples; eval = recall@20 / ndcg@20 on the last week.

    python train_rec.py --data data/clicks_2024q1 --dim 64 --layers 3 --amp
"""
import argparse
import math
import os
import random
import time
from contextlib import nullcontext

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--data", type=str, default="data/clicks_2024q1")
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--n_nbrs", type=int, default=20)
parser.add_argument("--bs", type=int, default=8192)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--emb_lr", type=float, default=5e-3)
parser.add_argument("--wd", type=float, default=1e-4)
parser.add_argument("--reg", type=float, default=1e-4)
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--topk", type=int, default=20)
parser.add_argument("--amp", action="store_true")
parser.add_argument("--seed", type=int, default=2020)
parser.add_argument("--eval_every", type=int, default=2)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
random.seed(args.seed)
np.random.seed(args.seed)
torch.manual_seed(args.seed)

# mixed precision: the mlp scorer + attention are the expensive part
amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010


# ---------------------------------------------------------------------------------------
# utils (copied from our old LightGCN repo: utils.py / dataloader.py)
# ---------------------------------------------------------------------------------------
def timer(fn):
    def wrap(*a, **kw):
        t = time.time()
        out = fn(*a, **kw)
        print(f"[{fn.__name__}] {time.time() - t:.1f}s")
        return out
    return wrap


@timer
def load_interactions(path):
    train = np.load(os.path.join(path, "train.npz"))
    test = np.load(os.path.join(path, "test.npz"))
    n_users = int(max(train["u"].max(), test["u"].max())) + 1
    n_items = int(max(train["i"].max(), test["i"].max())) + 1
    return train["u"], train["i"], test["u"], test["i"], n_users, n_items


def build_norm_adj(u, i, n_users, n_items):
    R = sp.csr_matrix((np.ones(len(u), dtype=np.float32), (u, i)), shape=(n_users, n_items))
    adj = sp.bmat([[None, R], [R.T, None]], format="csr")
    rowsum = np.array(adj.sum(axis=1)).flatten()
    d_inv = np.power(rowsum, -0.5)
    d_inv[np.isinf(d_inv)] = 0.
    d_mat = sp.diags(d_inv)
    norm_adj = d_mat.dot(adj).dot(d_mat).tocoo()
    idx = torch.from_numpy(np.vstack([norm_adj.row, norm_adj.col]).astype(np.int64))
    val = torch.from_numpy(norm_adj.data.astype(np.float32))
    return torch.sparse_coo_tensor(idx, val, norm_adj.shape).coalesce()


def sample_neighbours(R_csr, items, k):
    """k random co-clicked items per item (PinSage uses random walks, this is cheaper)"""
    out = np.zeros((len(items), k), dtype=np.int64)
    mask = np.zeros((len(items), k), dtype=bool)
    for r, it in enumerate(items):
        nb = R_csr[it].indices
        if len(nb) == 0:
            continue
        pick = np.random.choice(nb, size=min(k, len(nb)), replace=False)
        out[r, :len(pick)] = pick
        mask[r, :len(pick)] = True
    return torch.from_numpy(out), torch.from_numpy(mask)


class TripletDataset(Dataset):
    def __init__(self, u, i, n_items, user_pos):
        self.u = u
        self.i = i
        self.n_items = n_items
        self.user_pos = user_pos

    def __len__(self):
        return len(self.u)

    def __getitem__(self, idx):
        user = self.u[idx]
        pos = self.i[idx]
        while True:
            neg = np.random.randint(0, self.n_items)
            if neg not in self.user_pos[user]:
                break
        return user, pos, neg


def recall_ndcg_at_k(rating, test_items, k):
    _, topk = torch.topk(rating, k=k)
    topk = topk.cpu().numpy()
    recall, ndcg = 0.0, 0.0
    for row, gt in zip(topk, test_items):
        hits = np.isin(row, list(gt))
        recall += hits.sum() / max(1, len(gt))
        dcg = (hits / np.log2(np.arange(2, k + 2))).sum()
        idcg = (1.0 / np.log2(np.arange(2, min(len(gt), k) + 2))).sum()
        ndcg += dcg / idcg if idcg > 0 else 0.0
    return recall, ndcg


# ---------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------
class NeighbourAttention(nn.Module):
    """PinSage-like importance pooling over sampled co-click neighbours"""

    def __init__(self, dim):
        super().__init__()
        self.W = nn.Linear(dim, dim, bias=False)
        self.a = nn.Linear(2 * dim, 1, bias=False)
        self.leakyrelu = nn.LeakyReLU(0.2)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, h_self, h_nbrs, nbr_mask):
        # h_self: (B, d), h_nbrs: (B, k, d), nbr_mask: (B, k)
        wh = self.W(h_nbrs)
        ws = self.W(h_self).unsqueeze(1).expand_as(wh)
        e = self.leakyrelu(self.a(torch.cat([ws, wh], dim=-1))).squeeze(-1)
        e = e.masked_fill(nbr_mask == 0, -9e15)  # expect: AMP007
        att = F.softmax(e, dim=1)
        att = F.dropout(att, 0.1, training=self.training)
        agg = torch.bmm(att.unsqueeze(1), wh).squeeze(1)
        return F.relu(self.out(torch.cat([h_self, agg], dim=-1)))


class GraphRec(nn.Module):
    def __init__(self, n_users, n_items, dim, n_layers, graph):
        super().__init__()
        self.n_users = n_users
        self.n_items = n_items
        self.n_layers = n_layers
        self.user_emb = nn.Embedding(n_users, dim)
        self.item_emb = nn.Embedding(n_items, dim)
        nn.init.normal_(self.user_emb.weight, std=0.1)
        nn.init.normal_(self.item_emb.weight, std=0.1)
        self.graph = graph
        self.nbr_att = NeighbourAttention(dim)
        self.scorer = nn.Sequential(
            nn.Linear(2 * dim, dim),
            nn.ReLU(),
            nn.Linear(dim, 1),
        )

    def propagate(self):
        # item table may be stored in fp16, sparse mm wants fp32
        all_emb = torch.cat([self.user_emb.weight, self.item_emb.weight.float()])
        embs = [all_emb]
        for _ in range(self.n_layers):
            all_emb = torch.sparse.mm(self.graph, all_emb)
            embs.append(all_emb)
        light_out = sum(embs) / (self.n_layers + 1)
        users, items = torch.split(light_out, [self.n_users, self.n_items])
        return users, items

    def score(self, u, i):
        return self.scorer(torch.cat([u, i], dim=-1)).squeeze(-1)

    def forward(self, users, pos, neg, pos_nbrs, pos_mask, neg_nbrs, neg_mask):
        all_users, all_items = self.propagate()
        u = all_users[users]
        ip = self.nbr_att(all_items[pos], all_items[pos_nbrs], pos_mask)
        ineg = self.nbr_att(all_items[neg], all_items[neg_nbrs], neg_mask)
        pos_scores = self.score(u, ip)
        neg_scores = self.score(u, ineg)
        # L2 on the ego embeddings of the batch (LightGCN style)
        reg = (self.user_emb(users).norm(2).pow(2) +
               self.item_emb(pos).float().norm(2).pow(2) +
               self.item_emb(neg).float().norm(2).pow(2)) / 2 / float(len(users))
        return pos_scores, neg_scores, reg

    @torch.no_grad()
    def get_users_rating(self, users, chunk=100000):
        all_users, all_items = self.propagate()
        u = all_users[users]
        # dot-product shortlist for eval (the mlp scorer is too slow over 9M items)
        return torch.matmul(u, all_items.t())


def bpr_loss(pos_scores, neg_scores):
    return -torch.log(torch.sigmoid(pos_scores - neg_scores) + 1e-10).mean()  # expect: AMP011


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
tr_u, tr_i, te_u, te_i, n_users, n_items = load_interactions(args.data)
print(f"users {n_users} items {n_items} train {len(tr_u)} test {len(te_u)}")
R_item = sp.csr_matrix((np.ones(len(tr_u), dtype=np.float32), (tr_i, tr_u)), shape=(n_items, n_users))
item_item = (R_item @ R_item.T).tocsr()
user_pos = [set() for _ in range(n_users)]
for a, b in zip(tr_u, tr_i):
    user_pos[a].add(b)
test_pos = {}
for a, b in zip(te_u, te_i):
    test_pos.setdefault(a, set()).add(b)

graph = build_norm_adj(tr_u, tr_i, n_users, n_items).to(device)
loader = DataLoader(TripletDataset(tr_u, tr_i, n_items, user_pos), batch_size=args.bs, shuffle=True,
                    num_workers=4, drop_last=True)

model = GraphRec(n_users, n_items, args.dim, args.layers, graph).to(device)
# 9M x 64 in fp32 does not fit next to the graph on the 24GB cards -> keep the item table in fp16
model.item_emb.half()  # expect: AMP001

dense_params = [p for n, p in model.named_parameters() if not n.startswith("item_emb")]
optimizer = torch.optim.AdamW(dense_params, lr=args.lr, weight_decay=args.wd)
item_optimizer = torch.optim.Adam(model.item_emb.parameters(), lr=args.emb_lr)  # expect: AMP011


def train_one_epoch(epoch):
    model.train()
    total, n = 0.0, 0
    t0 = time.time()
    for it, (users, pos, neg) in enumerate(loader):
        pos_nbrs, pos_mask = sample_neighbours(item_item, pos.numpy(), args.n_nbrs)
        neg_nbrs, neg_mask = sample_neighbours(item_item, neg.numpy(), args.n_nbrs)
        users, pos, neg = users.to(device), pos.to(device), neg.to(device)
        pos_nbrs, pos_mask = pos_nbrs.to(device), pos_mask.to(device)
        neg_nbrs, neg_mask = neg_nbrs.to(device), neg_mask.to(device)

        with amp_ctx:
            pos_scores, neg_scores, reg = model(users, pos, neg, pos_nbrs, pos_mask, neg_nbrs, neg_mask)
            loss = bpr_loss(pos_scores, neg_scores) + args.reg * reg

        optimizer.zero_grad(set_to_none=True)
        item_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        item_optimizer.step()

        total += loss.item()
        n += 1
        if it % 200 == 0:
            print(f"ep {epoch} it {it}/{len(loader)} loss {total / n:.4f} ({time.time() - t0:.0f}s)")
    return total / max(n, 1)


def evaluate():
    model.eval()
    users = np.array(sorted(test_pos.keys()))
    recall, ndcg = 0.0, 0.0
    for start in range(0, len(users), 4096):
        batch_users = users[start:start + 4096]
        rating = model.get_users_rating(torch.from_numpy(batch_users).to(device))
        # mask out training items
        exclude_index, exclude_items = [], []
        for r, u in enumerate(batch_users):
            items = list(user_pos[u])
            exclude_index.extend([r] * len(items))
            exclude_items.extend(items)
        rating[exclude_index, exclude_items] = -(1 << 10)
        r, g = recall_ndcg_at_k(rating, [test_pos[u] for u in batch_users], args.topk)
        recall += r
        ndcg += g
    return recall / len(users), ndcg / len(users)


best_recall = 0.0
best_ndcg = 0.0
for epoch in range(args.epochs):
    tr_loss = train_one_epoch(epoch)
    print(f"epoch {epoch} bpr {tr_loss:.4f}")
    if (epoch + 1) % args.eval_every == 0:
        rec, ndcg = evaluate()
        print(f"[eval] recall@{args.topk} {rec:.4f} ndcg@{args.topk} {ndcg:.4f}")
        if rec > best_recall:
            best_recall, best_ndcg = rec, ndcg
            torch.save(model.state_dict(), f"checkpoints/graphrec_d{args.dim}_l{args.layers}.pt")
print(f"best recall {best_recall:.4f} ndcg {best_ndcg:.4f}")
