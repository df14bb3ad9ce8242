"""Two-tower candidate retrieval (dot-product scoring) with a click-through-rate head.

In-batch sampled softmax with logQ correction, plus similar-item hard negatives mined
from a cached table of item embeddings that is rebuilt every few epochs.
"""
import argparse
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from recsys_data import InteractionDataset, ItemCatalog  # local module


@dataclass
class TowerConfig:
    n_users: int = 2_000_000
    n_items: int = 800_000
    n_categories: int = 4096
    n_genres: int = 64
    dense_dim: int = 32
    emb_dim: int = 64
    hidden: tuple = (512, 256)
    out_dim: int = 128


@dataclass
class TrainerConfig:
    lr: float = 1e-3
    weight_decay: float = 1e-6
    epochs: int = 20
    batch_size: int = 4096
    temperature: float = 0.05
    ctr_weight: float = 0.5
    max_grad_norm: float = 5.0
    amp: bool = True
    hard_negative_pool: int = 65536
    refresh_every: int = 2
    log_every: int = 200
    ckpt_dir: str = "runs/two_tower"
    extra: dict = field(default_factory=dict)


def mlp(sizes):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class UserTower(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.user_emb = nn.Embedding(cfg.n_users, cfg.emb_dim)
        self.history = nn.EmbeddingBag(cfg.n_items, cfg.emb_dim, mode="mean")
        self.net = mlp([2 * cfg.emb_dim + cfg.dense_dim, *cfg.hidden, cfg.out_dim])

    def forward(self, user_ids, hist_items, hist_offsets, dense):
        x = torch.cat([self.user_emb(user_ids), self.history(hist_items, hist_offsets), dense], dim=-1)
        return self.net(x)


class ItemTower(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.out_dim = cfg.out_dim
        self.item_emb = nn.Embedding(cfg.n_items, cfg.emb_dim)
        self.cat_emb = nn.Embedding(cfg.n_categories, cfg.emb_dim)
        self.net = mlp([2 * cfg.emb_dim, *cfg.hidden, cfg.out_dim])

    def forward(self, item_ids, categories):
        x = torch.cat([self.item_emb(item_ids), self.cat_emb(categories)], dim=-1)
        return self.net(x)


class TwoTower(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.user_tower = UserTower(cfg)
        self.item_tower = ItemTower(cfg)
        self.ctr_head = mlp([2 * cfg.out_dim, 128, 1])

    def ctr_prob(self, u, v):
        return torch.sigmoid(self.ctr_head(torch.cat([u, v], dim=-1))).squeeze(-1)


def sampled_softmax_loss(user_vecs, item_vecs, item_log_q, temperature):
    """In-batch softmax; row i's positive is column i, the other columns are negatives."""
    logits = user_vecs @ item_vecs.t() / temperature
    logits = logits - item_log_q[None, :]
    labels = torch.arange(user_vecs.shape[0], device=user_vecs.device)
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def build_item_cache(item_tower, item_categories, device, batch_size=65536):
    n_items = item_categories.shape[0]
    cache = torch.empty(n_items, item_tower.out_dim, dtype=torch.float16, device=device)
    for start in range(0, n_items, batch_size):
        ids = torch.arange(start, min(start + batch_size, n_items), device=device)
        cache[ids] = item_tower(ids, item_categories[ids])
    # unit-normalise so the hard-negative miner ranks by cosine similarity
    norms = cache.norm(dim=-1, keepdim=True)  # expect: AMP004
    return cache / (norms + 1e-8)  # expect: AMP011


def pretrain_item_tower(item_tower, genre_head, loader, device, epochs=1, lr=1e-3):
    """Warm-start the item tower by predicting each item's genre."""
    optimizer = torch.optim.Adam(list(item_tower.parameters()) + list(genre_head.parameters()), lr=lr)
    for _ in range(epochs):
        for item_ids, cats, genres in loader:
            item_ids, cats, genres = item_ids.to(device), cats.to(device), genres.to(device)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                logits = genre_head(item_tower(item_ids, cats))
                loss = F.cross_entropy(logits, genres)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


class TwoTowerTrainer:
    def __init__(self, model, cfg: TrainerConfig, item_log_q, item_categories, device):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.item_log_q = item_log_q
        self.item_categories = item_categories
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.ctr_criterion = nn.BCELoss()
        self.item_cache = None
        self.step = 0

    def _clip_grads(self):
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)

    @torch.no_grad()
    def _mine_hard_negatives(self, pos_items):
        cand = torch.randint(0, self.item_cache.shape[0], (self.cfg.hard_negative_pool,), device=self.device)
        sims = self.item_cache[pos_items].float() @ self.item_cache[cand].float().t()
        sims[cand[None, :] == pos_items[:, None]] = float("-inf")
        return cand[sims.argmax(dim=-1)]

    def train_step(self, batch):
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        items = batch["item_ids"]
        log_q = self.item_log_q[items]
        neg_ids = self._mine_hard_negatives(items) if self.item_cache is not None else None

        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            u = self.model.user_tower(batch["user_ids"], batch["hist_items"], batch["hist_offsets"], batch["dense"])
            v = self.model.item_tower(items, self.item_categories[items])
            click_prob = self.model.ctr_prob(u, v)
            ctr_loss = self.ctr_criterion(click_prob, batch["clicked"].float())  # expect: AMP003
            if neg_ids is not None:
                v = torch.cat([v, self.model.item_tower(neg_ids, self.item_categories[neg_ids])], dim=0)
                log_q = torch.cat([log_q, self.item_log_q[neg_ids]], dim=0)
        ret_loss = sampled_softmax_loss(u, v, log_q, self.cfg.temperature)  # expect: AMP002
        loss = ret_loss + self.cfg.ctr_weight * ctr_loss

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        grad_norm = self._clip_grads()  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        return {"loss": loss.item(), "retrieval": ret_loss.item(), "ctr": ctr_loss.item(), "grad_norm": float(grad_norm)}

    @torch.no_grad()
    def evaluate_recall(self, loader, k=100):
        self.model.eval()
        cache = build_item_cache(self.model.item_tower, self.item_categories, self.device).float()
        hits, total = 0, 0
        for batch in loader:
            batch = {key: val.to(self.device) for key, val in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                u = self.model.user_tower(batch["user_ids"], batch["hist_items"], batch["hist_offsets"], batch["dense"])
            topk = (u.float() @ cache.t()).topk(k, dim=-1).indices
            hits += (topk == batch["item_ids"][:, None]).any(dim=-1).sum().item()
            total += topk.shape[0]
        self.model.train()
        return hits / max(1, total)

    def save(self, path):
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "step": self.step}, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/interactions")
    p.add_argument("--epochs", type=int, default=TrainerConfig.epochs)
    p.add_argument("--pretrain-epochs", type=int, default=1)
    p.add_argument("--no-amp", action="store_true")
    args = p.parse_args()

    device = torch.device("cuda")
    tcfg, cfg = TowerConfig(), TrainerConfig(epochs=args.epochs, amp=not args.no_amp)
    os.makedirs(cfg.ckpt_dir, exist_ok=True)
    catalog = ItemCatalog(args.data)
    item_categories = torch.as_tensor(catalog.categories, device=device)
    counts = torch.as_tensor(catalog.interaction_counts, dtype=torch.float32, device=device)
    item_log_q = torch.log(counts / counts.sum() + 1e-12)

    model = TwoTower(tcfg).to(device)
    if args.pretrain_epochs:
        genre_head = nn.Linear(tcfg.out_dim, tcfg.n_genres).to(device)
        pretrain_item_tower(model.item_tower, genre_head, DataLoader(catalog, batch_size=8192, shuffle=True),
                            device, epochs=args.pretrain_epochs)

    train_loader = DataLoader(InteractionDataset(args.data, "train"), batch_size=cfg.batch_size, shuffle=True,
                              num_workers=8, collate_fn=InteractionDataset.collate, drop_last=True)
    valid_loader = DataLoader(InteractionDataset(args.data, "valid"), batch_size=cfg.batch_size,
                              num_workers=4, collate_fn=InteractionDataset.collate)
    trainer = TwoTowerTrainer(model, cfg, item_log_q, item_categories, device)
    best_recall = 0.0
    for epoch in range(cfg.epochs):
        if epoch > 0 and epoch % cfg.refresh_every == 0:
            trainer.item_cache = build_item_cache(model.item_tower, item_categories, device)
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            stats = trainer.train_step(batch)
            if it % cfg.log_every == 0:
                print(json.dumps({"epoch": epoch, "it": it, **{k: round(v, 4) for k, v in stats.items()}}))
        recall = trainer.evaluate_recall(valid_loader)
        print(f"epoch {epoch} recall@100 {recall:.4f} ({time.time() - t0:.0f}s)")
        if recall > best_recall:
            best_recall = recall
            trainer.save(os.path.join(cfg.ckpt_dir, "best.pt"))


if __name__ == "__main__":
    main()
