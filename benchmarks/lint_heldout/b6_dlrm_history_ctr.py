"""DLRM-style click-through-rate model with a user-history tower (DIN-like attention pooling
plus a short-term mean of the most recent items), trained on Criteo-like TSV shards.

Each line: label \t 13 integer features \t 26 categorical hashes \t item \t comma-separated history.
Sparse tables use SparseAdam, the MLPs Adagrad, as in the reference DLRM setup.

    python train_dlrm_hist.py --data /data/ctr/day_{0..22}.tsv --eval-data /data/ctr/day_23.tsv
"""
import argparse
import glob
import math
import os
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import torch as th
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.utils.data import DataLoader, IterableDataset


@dataclass
class DLRMConfig:
    num_dense: int = 13
    table_sizes: List[int] = field(default_factory=lambda: [1_000_000] * 8 + [100_000] * 10 + [10_000] * 8)
    emb_dim: int = 64
    bot_mlp: List[int] = field(default_factory=lambda: [512, 256, 64])
    top_mlp: List[int] = field(default_factory=lambda: [1024, 1024, 512, 256, 1])
    item_vocab: int = 2_000_000
    hist_len: int = 50
    recent: int = 5
    lr: float = 0.01
    sparse_lr: float = 1e-3
    batch_size: int = 4096
    clip_norm: float = 0.0
    device: str = "cuda"
    ckpt_dir: str = "checkpoints/dlrm-hist"


def make_mlp(sizes, sigmoid_last=False):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        last = i == len(sizes) - 2
        layers.append(nn.Sigmoid() if (last and sigmoid_last) else nn.ReLU())
    return nn.Sequential(*layers)


class HistoryTower(nn.Module):
    def __init__(self, vocab, dim, recent=5):
        super().__init__()
        self.item_emb = nn.Embedding(vocab, dim, padding_idx=0, sparse=True)
        self.proj = nn.Linear(dim, dim)
        self.att = nn.Linear(dim, 1)
        self.recent = recent

    def forward(self, hist_ids, target_emb):
        mask = hist_ids != 0
        h = F.relu(self.proj(self.item_emb(hist_ids)))  # (B, L, D)
        scores = self.att(h * target_emb.unsqueeze(1)).squeeze(-1)
        scores = scores.masked_fill(~mask, th.finfo(scores.dtype).min)
        w = scores.softmax(dim=-1)
        interest = th.bmm(w.unsqueeze(1).to(h.dtype), h).squeeze(1)
        short_term = h[:, -self.recent:].mean(dim=1)  # expect: AMP004
        return interest, short_term


class DLRMWithHistory(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.emb_dim
        self.emb_l = nn.ModuleList([nn.EmbeddingBag(n, d, mode="sum", sparse=True) for n in cfg.table_sizes])
        self.bot_l = make_mlp([cfg.num_dense] + cfg.bot_mlp)
        self.history = HistoryTower(cfg.item_vocab, d, cfg.recent)
        num_f = len(cfg.table_sizes) + 3  # dense + tables + interest + short-term
        li, lj = th.tril_indices(num_f, num_f, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top_l = make_mlp([d + num_f * (num_f - 1) // 2] + cfg.top_mlp, sigmoid_last=True)

    def interact(self, x, ly):
        B, d = x.shape
        T = th.cat([x] + ly, dim=1).view(B, -1, d)
        Z = th.bmm(T, T.transpose(1, 2))
        return th.cat([x, Z[:, self.li, self.lj]], dim=1)

    def forward(self, dense, sparse, hist, item):
        x = self.bot_l(dense)
        offsets = th.arange(sparse.shape[1], device=sparse.device)
        ly = [emb(sparse[k], offsets) for k, emb in enumerate(self.emb_l)]
        interest, short_term = self.history(hist, self.history.item_emb(item))
        z = self.interact(x, ly + [interest, short_term])
        return self.top_l(z).squeeze(-1)


class CTRShards(IterableDataset):
    def __init__(self, pattern, cfg):
        self.files = sorted(glob.glob(pattern))
        self.cfg = cfg

    def parse(self, line):
        cols = line.rstrip("\n").split("\t")
        label = float(cols[0])
        dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in cols[1:14]]
        sparse = [int(v, 16) % n if v else 0 for v, n in zip(cols[14:40], self.cfg.table_sizes)]
        item = int(cols[40]) % self.cfg.item_vocab
        hist = [int(v) % self.cfg.item_vocab for v in cols[41].split(",") if v][-self.cfg.hist_len:]
        hist = [0] * (self.cfg.hist_len - len(hist)) + hist
        return label, dense, sparse, item, hist

    def __iter__(self):
        for path in self.files:
            with open(path) as f:
                buf = []
                for line in f:
                    buf.append(self.parse(line))
                    if len(buf) == self.cfg.batch_size:
                        yield self.collate(buf)
                        buf = []

    @staticmethod
    def collate(rows):
        label, dense, sparse, item, hist = zip(*rows)
        return {
            "label": th.tensor(label, dtype=th.float32),
            "dense": th.tensor(dense, dtype=th.float32),
            "sparse": th.tensor(sparse, dtype=th.long).t().contiguous(),
            "item": th.tensor(item, dtype=th.long),
            "hist": th.tensor(hist, dtype=th.long),
        }


def build_model(cfg, device):
    model = DLRMWithHistory(cfg)
    # bf16 weights halve the memory of the 26 tables + the item table
    return model.to(device=device, dtype=th.bfloat16)  # expect: AMP001


class DLRMTrainer:
    def __init__(self, cfg, model):
        self.cfg = cfg
        self.model = model
        self.device = th.device(cfg.device)
        self.sparse_params = [p for n, p in model.named_parameters() if "emb" in n]
        self.dense_params = [p for n, p in model.named_parameters() if "emb" not in n]
        self.sparse_opt = th.optim.SparseAdam(self.sparse_params, lr=cfg.sparse_lr)
        self.dense_opt = th.optim.Adagrad(self.dense_params, lr=cfg.lr)
        self.loss_fn = nn.BCELoss(reduction="mean")
        self.scaler = th.amp.GradScaler("cuda")  # expect: AMP010
        self.step = 0

    def _to_device(self, batch):
        return {k: (v.to(self.device, non_blocking=True).to(th.bfloat16) if v.is_floating_point() else v.to(self.device, non_blocking=True)) for k, v in batch.items()}  # expect: AMP001

    def train_step(self, batch):
        b = self._to_device(batch)
        with th.autocast("cuda", dtype=th.bfloat16):
            prob = self.model(b["dense"], b["sparse"], b["hist"], b["item"])
            loss = self.loss_fn(prob, b["label"])  # expect: AMP003
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.cfg.clip_norm > 0:
            self.scaler.unscale_(self.dense_opt)
            th.nn.utils.clip_grad_norm_(self.dense_params, self.cfg.clip_norm)
        self.scaler.step(self.dense_opt)
        self.sparse_opt.step()  # expect: AMP006
        self.scaler.update()
        self.step += 1
        return loss.detach()

    def train_epoch(self, loader, epoch, log_every=200):
        self.model.train()
        t0, running = time.time(), 0.0
        for it, batch in enumerate(loader):
            running += self.train_step(batch).float().item()
            if (it + 1) % log_every == 0:
                dt = time.time() - t0
                print(f"epoch {epoch} it {it + 1} loss {running / log_every:.5f} {log_every * self.cfg.batch_size / dt:.0f} samples/s scale {self.scaler.get_scale():.0f}")
                t0, running = time.time(), 0.0

    @th.no_grad()
    def evaluate(self, loader, max_batches=500):
        self.model.eval()
        preds, labels, total_ll, n = [], [], 0.0, 0
        for i, batch in enumerate(loader):
            if i >= max_batches:
                break
            b = self._to_device(batch)
            with th.autocast("cuda", dtype=th.bfloat16):
                prob = self.model(b["dense"], b["sparse"], b["hist"], b["item"])
            y = b["label"]
            # log-loss kept in bf16: its exponent range is fp32's, so the 1e-12 guard survives
            ll = -(y * th.log(prob + 1e-12) + (1 - y) * th.log(1 - prob + 1e-12))
            total_ll += ll.float().sum().item()
            n += ll.numel()
            preds.append(prob.float().cpu())
            labels.append(y.float().cpu())
        self.model.train()
        auc = roc_auc_score(th.cat(labels).numpy(), th.cat(preds).numpy())
        return total_ll / max(n, 1), auc

    def save(self, tag):
        os.makedirs(self.cfg.ckpt_dir, exist_ok=True)
        th.save({"model": self.model.state_dict(), "dense_opt": self.dense_opt.state_dict(), "sparse_opt": self.sparse_opt.state_dict(), "scaler": self.scaler.state_dict(), "step": self.step}, os.path.join(self.cfg.ckpt_dir, f"{tag}.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--eval-data", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip-norm", type=float, default=0.0)
    args = p.parse_args()

    cfg = DLRMConfig(batch_size=args.batch_size, lr=args.lr, clip_norm=args.clip_norm)
    th.manual_seed(0)
    np.random.seed(0)
    model = build_model(cfg, cfg.device)
    trainer = DLRMTrainer(cfg, model)
    train_loader = DataLoader(CTRShards(args.data, cfg), batch_size=None, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(CTRShards(args.eval_data, cfg), batch_size=None, num_workers=2)

    best_auc = 0.0
    for epoch in range(args.epochs):
        trainer.train_epoch(train_loader, epoch)
        logloss, auc = trainer.evaluate(eval_loader)
        print(f"epoch {epoch}: eval logloss {logloss:.5f} AUC {auc:.5f}")
        if auc > best_auc:
            best_auc = auc
            trainer.save("best")
    trainer.save("last")


if __name__ == "__main__":
    main()
