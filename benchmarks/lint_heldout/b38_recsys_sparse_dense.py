"""CTR ranking model (DIN-style target attention + DCN cross layers) trained on CPU.

Embedding tables are sparse (SparseAdam), the dense towers use Adam. bf16 CPU
autocast keeps the towers fast on AVX512-BF16 / AMX hosts.

    python b38_recsys_sparse_dense.py --epochs 3 --batch-size 4096 --threads 32
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class DINAttention(nn.Module):
    """Local activation unit (Zhou et al. 2018): weights are not softmax-normalised."""

    def __init__(self, dim, hidden=64):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4 * dim, hidden), nn.PReLU(), nn.Linear(hidden, 1))

    def forward(self, query, keys, mask):
        q = query.unsqueeze(1).expand_as(keys)
        scores = self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        scores = scores.masked_fill(~mask, 0.0)
        return (scores.unsqueeze(-1) * keys).sum(dim=1)  # expect: AMP004


class CrossNet(nn.Module):
    def __init__(self, dim, layers=3):
        super().__init__()
        self.w = nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(layers)])
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(dim)) for _ in range(layers)])

    def forward(self, x0):
        x = x0
        for w, b in zip(self.w, self.b):
            x = x0 * w(x) + b + x
        return x


class DINRanker(nn.Module):
    def __init__(self, n_users, n_items, n_cats, n_dense, dim=32, hidden=256, recent_k=5):
        super().__init__()
        self.recent_k = recent_k
        self.user_emb = nn.Embedding(n_users, dim, sparse=True)
        self.item_emb = nn.Embedding(n_items, dim, sparse=True, padding_idx=0)
        self.cat_emb = nn.Embedding(n_cats, dim, sparse=True)
        self.dense_proj = nn.Linear(n_dense, dim)
        self.item_proj = nn.Linear(dim, dim)
        self.hist_proj = nn.Linear(dim, dim)
        self.din = DINAttention(dim)
        self.cross = CrossNet(6 * dim)
        self.mlp = nn.Sequential(nn.Linear(6 * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden // 2), nn.ReLU(),
                                 nn.Linear(hidden // 2, 1))

    def forward(self, user, item, cat, dense, hist, hist_mask):
        target = self.item_proj(self.item_emb(item))
        keys = self.hist_proj(self.item_emb(hist))
        interest = self.din(target, keys, hist_mask)
        recent = keys[:, -self.recent_k:].mean(dim=1)  # expect: AMP004
        user_vec = self.user_emb(user)
        hist_count = hist_mask.float().sum(dim=1, keepdim=True).clamp(min=1.0)
        hist_avg = (self.item_emb(hist) * hist_mask.unsqueeze(-1)).sum(dim=1) / hist_count
        x = torch.cat([user_vec + hist_avg, target, self.cat_emb(cat), self.dense_proj(dense), interest, recent],
                      dim=-1)
        return torch.sigmoid(self.mlp(self.cross(x)).squeeze(-1))


def synthetic_clicks(n, n_users, n_items, n_cats, n_dense, hist_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(0, n_users, (n,), generator=g)
    item = torch.randint(1, n_items, (n,), generator=g)
    cat = item % n_cats
    dense = torch.randn(n, n_dense, generator=g)
    lengths = torch.randint(1, hist_len + 1, (n,), generator=g)
    hist_mask = torch.arange(hist_len)[None, :] >= (hist_len - lengths[:, None])
    hist = torch.randint(1, n_items, (n, hist_len), generator=g).masked_fill(~hist_mask, 0)
    label = ((hist == item[:, None]).any(1) | (dense[:, 0] > 1.0)).float()
    return torch.utils.data.TensorDataset(user, item, cat, dense, hist, hist_mask, label)


class Trainer:
    def __init__(self, args, meta):
        self.args = args
        self.model = DINRanker(**meta)
        sparse_params = [p for n, p in self.model.named_parameters() if "_emb." in n]
        self.dense_params = [p for n, p in self.model.named_parameters() if "_emb." not in n]
        self.dense_opt = torch.optim.Adam(self.dense_params, lr=args.lr, weight_decay=args.wd)
        self.sparse_opt = torch.optim.SparseAdam(sparse_params, lr=args.sparse_lr)
        self.criterion = nn.BCELoss()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)  # expect: AMP010
        self.epoch, self.global_step = 0, 0

    def train_step(self, batch):
        user, item, cat, dense, hist, hist_mask, label = batch
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prob = self.model(user, item, cat, dense, hist, hist_mask)
            loss = self.criterion(prob, label)  # expect: AMP003
            self.scaler.scale(loss).backward()  # expect: AMP008
        torch.nn.utils.clip_grad_norm_(self.dense_params, self.args.max_norm)  # expect: AMP005
        self.scaler.step(self.dense_opt)
        self.scaler.update()
        self.sparse_opt.step()  # expect: AMP006
        self.global_step += 1
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        probs, labels = [], []
        for user, item, cat, dense, hist, hist_mask, label in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                p = self.model(user, item, cat, dense, hist, hist_mask)
            probs.append(p.float())
            labels.append(label)
        self.model.train()
        p, y = torch.cat(probs), torch.cat(labels)
        logloss = F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y).item()
        order = torch.argsort(p)
        ranks = torch.empty_like(p)
        ranks[order] = torch.arange(1, len(p) + 1, dtype=p.dtype)
        n_pos = y.sum()
        n_neg = len(y) - n_pos
        auc = ((ranks * y).sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg).clamp(min=1)
        return {"logloss": logloss, "auc": auc.item()}

    def state_dict(self):
        return {"model": self.model.state_dict(), "dense_opt": self.dense_opt.state_dict(),
                "sparse_opt": self.sparse_opt.state_dict(), "scaler": self.scaler.state_dict(),
                "epoch": self.epoch, "global_step": self.global_step}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.dense_opt.load_state_dict(sd["dense_opt"])
        self.sparse_opt.load_state_dict(sd["sparse_opt"])
        self.scaler.load_state_dict(sd["scaler"])
        self.epoch, self.global_step = sd["epoch"], sd["global_step"]

    def fit(self, train_loader, val_loader):
        best_auc = -1e9
        while self.epoch < self.args.epochs:
            t0, running = time.time(), []
            for i, batch in enumerate(train_loader):
                running.append(self.train_step(batch).item())
                if i % self.args.log_every == 0:
                    print(f"ep {self.epoch} it {i} loss {np.mean(running[-self.args.log_every:]):.4f} "
                          f"scale {self.scaler.get_scale():.0f} {len(running) * self.args.batch_size / (time.time() - t0):.0f} ex/s")
            metrics = self.evaluate(val_loader)
            print(f"epoch {self.epoch} val {metrics}")
            self.epoch += 1
            torch.save(self.state_dict(), os.path.join(self.args.out, "last.pt"))
            if metrics["auc"] > best_auc:
                best_auc = metrics["auc"]
                torch.save(self.model.state_dict(), os.path.join(self.args.out, "best_model.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sparse-lr", type=float, default=5e-3)
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--max-norm", type=float, default=10.0)
    p.add_argument("--n-users", type=int, default=100_000)
    p.add_argument("--n-items", type=int, default=50_000)
    p.add_argument("--n-cats", type=int, default=500)
    p.add_argument("--n-dense", type=int, default=13)
    p.add_argument("--hist-len", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", default="runs/din")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(args.threads)

    meta = dict(n_users=args.n_users, n_items=args.n_items, n_cats=args.n_cats, n_dense=args.n_dense)
    train_ds = synthetic_clicks(400_000, hist_len=args.hist_len, seed=0, **meta)
    val_ds = synthetic_clicks(40_000, hist_len=args.hist_len, seed=1, **meta)
    train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=args.batch_size * 4)
    trainer = Trainer(args, meta)
    if args.resume and os.path.exists(os.path.join(args.out, "last.pt")):
        trainer.load_state_dict(torch.load(os.path.join(args.out, "last.pt")))
    trainer.fit(train_loader, val_loader)


if __name__ == "__main__":
    main()
