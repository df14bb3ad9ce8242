"""Candidate-retrieval and ranking models for the feed recommender.

Two-tower retrieval trained with in-batch softmax (logQ-corrected) or sampled softmax over
random negatives, a pointwise CTR head, and a NeuMF ranker trained with BPR.
"""
import argparse
import logging
import math
import os

import torch as th
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from recdata import InteractionDataset, NegativeSampler, load_item_popularity
from recmetrics import recall_at_k, ndcg_at_k

logger = logging.getLogger(__name__)


def mlp(dims, dropout=0.1):
    layers = []
    for i in range(len(dims) - 2):
        layers += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU(), nn.Dropout(dropout)]
    layers.append(nn.Linear(dims[-2], dims[-1]))
    return nn.Sequential(*layers)


class Tower(nn.Module):
    def __init__(self, n_ids, n_feats, dim=64, hidden=(256, 128)):
        super().__init__()
        self.id_emb = nn.Embedding(n_ids, dim)
        self.feat_emb = nn.EmbeddingBag(n_feats, dim, mode="mean")
        self.net = mlp([2 * dim, *hidden, dim])

    def forward(self, ids, feats, offsets):
        h = th.cat([self.id_emb(ids), self.feat_emb(feats, offsets)], dim=-1)
        return self.net(h)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_user_feats, n_item_feats, dim=64):
        super().__init__()
        self.user_tower = Tower(n_users, n_user_feats, dim)
        self.item_tower = Tower(n_items, n_item_feats, dim)
        self.ctr_head = nn.Linear(2 * dim, 1)

    def encode_users(self, batch):
        return self.user_tower(batch["user"], batch["user_feats"], batch["user_offsets"])

    def encode_items(self, ids, feats, offsets):
        return self.item_tower(ids, feats, offsets)

    def ctr_logit(self, u, v):
        return self.ctr_head(th.cat([u, v], dim=-1)).squeeze(-1)


class NeuMF(nn.Module):
    def __init__(self, n_users, n_items, dim=32, layers=(64, 32, 16)):
        super().__init__()
        self.gmf_user = nn.Embedding(n_users, dim)
        self.gmf_item = nn.Embedding(n_items, dim)
        self.mlp_user = nn.Embedding(n_users, layers[0] // 2)
        self.mlp_item = nn.Embedding(n_items, layers[0] // 2)
        self.mlp = mlp(list(layers))
        self.predict = nn.Linear(dim + layers[-1], 1)

    def forward(self, users, items):
        gmf = self.gmf_user(users) * self.gmf_item(items)
        h = F.relu(self.mlp(th.cat([self.mlp_user(users), self.mlp_item(items)], dim=-1)))
        return self.predict(th.cat([gmf, h], dim=-1)).squeeze(-1)


class MatrixFactorization(nn.Module):
    def __init__(self, n_users, n_items, dim=64):
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.item = nn.Embedding(n_items, dim)
        self.user_bias = nn.Embedding(n_users, 1)
        self.item_bias = nn.Embedding(n_items, 1)

    def forward(self, u, i):
        # accumulate the dot product in fp32 even when the tables are stored in fp16
        dot = (self.user(u).float() * self.item(i).float()).sum(-1)
        return dot + self.user_bias(u).squeeze(-1).float() + self.item_bias(i).squeeze(-1).float()


class RetrievalTrainer:
    def __init__(self, cfg, dataset_meta, device):
        self.cfg = cfg
        self.device = device
        self.model = TwoTower(dataset_meta.n_users, dataset_meta.n_items,
                              dataset_meta.n_user_feats, dataset_meta.n_item_feats, cfg.dim).to(device)
        self.optimizer = th.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.wd)
        self.scaler = th.amp.GradScaler("cuda", enabled=cfg.amp)
        self.bce = nn.BCELoss()
        self.temperature = cfg.temperature
        self.log_q = th.log(load_item_popularity(cfg.data_dir).to(device) + 1e-10)

    def _update(self, loss):
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_step_inbatch(self, batch):
        with th.autocast("cuda", dtype=th.float16, enabled=self.cfg.amp):
            q = F.normalize(self.model.encode_users(batch), dim=-1)
            c = F.normalize(self.model.encode_items(batch["item"], batch["item_feats"], batch["item_offsets"]), dim=-1)
            logits = q @ c.t() / self.temperature
            # the same item can be the positive of several rows
            accidental = batch["item"][None, :] == batch["item"][:, None]
            accidental.fill_diagonal_(False)
            logits = logits.masked_fill(accidental, -1e9)  # expect: AMP007
            logits = logits - self.log_q[batch["item"]][None, :]
            labels = th.arange(logits.size(0), device=logits.device)
            loss = F.cross_entropy(logits, labels)
        self._update(loss)
        return loss.detach()

    def train_step_sampled(self, batch, negatives):
        with th.autocast("cuda", dtype=th.float16, enabled=self.cfg.amp):
            q = self.model.encode_users(batch)
            pos = self.model.encode_items(batch["item"], batch["item_feats"], batch["item_offsets"])
            neg = self.model.encode_items(negatives["item"], negatives["item_feats"], negatives["item_offsets"])
            cand = th.cat([pos, neg], dim=0)
            logits = q @ cand.t() / self.temperature
        labels = th.arange(q.size(0), device=q.device)
        loss = F.cross_entropy(logits, labels)  # expect: AMP002
        self._update(loss)
        return loss.detach()

    def train_step_pointwise(self, batch):
        with th.autocast("cuda", dtype=th.float16, enabled=self.cfg.amp):
            u = self.model.encode_users(batch)
            v = self.model.encode_items(batch["item"], batch["item_feats"], batch["item_offsets"])
            prob = th.sigmoid(self.model.ctr_logit(u, v))
            loss = self.bce(prob, batch["click"].float())  # expect: AMP003
        self._update(loss)
        return loss.detach()

    @th.no_grad()
    def evaluate(self, loader, item_index, k=50):
        self.model.eval()
        recalls, ndcgs, log_losses = [], [], []
        item_vecs = F.normalize(self.model.encode_items(*item_index), dim=-1)
        for batch in loader:
            batch = {key: val.to(self.device) for key, val in batch.items()}
            q = F.normalize(self.model.encode_users(batch), dim=-1)
            topk = (q @ item_vecs.t()).topk(k, dim=-1).indices
            recalls.append(recall_at_k(topk, batch["item"]))
            ndcgs.append(ndcg_at_k(topk, batch["item"]))
            v = self.model.encode_items(batch["item"], batch["item_feats"], batch["item_offsets"])
            prob = th.sigmoid(self.model.ctr_logit(q, v))
            log_losses.append(self.bce(prob, batch["click"].float()).item())
        self.model.train()
        n = max(len(recalls), 1)
        return sum(recalls) / n, sum(ndcgs) / n, sum(log_losses) / n


def train_retrieval(args, meta, train_set, eval_set, item_index):
    device = th.device("cuda")
    trainer = RetrievalTrainer(args, meta, device)
    sampler = NegativeSampler(meta.n_items, args.num_negatives, device=device)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=1024)
    for epoch in range(args.epochs):
        for step, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if args.objective == "inbatch":
                loss = trainer.train_step_inbatch(batch)
            elif args.objective == "sampled":
                loss = trainer.train_step_sampled(batch, sampler.sample(batch["item"]))
            else:
                loss = trainer.train_step_pointwise(batch)
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        recall, ndcg, ll = trainer.evaluate(eval_loader, item_index)
        logger.info("epoch %d recall@50 %.4f ndcg@50 %.4f logloss %.4f", epoch, recall, ndcg, ll)
        th.save(trainer.model.state_dict(), os.path.join(args.out, f"two_tower_{epoch}.pt"))


def train_bpr(args, meta, train_set):
    device = th.device("cuda")
    model = NeuMF(meta.n_users, meta.n_items).to(device)
    optimizer = th.optim.Adam(model.parameters(), lr=args.lr)
    scaler = th.amp.GradScaler("cuda")
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4)
    for epoch in range(args.epochs):
        total = 0.0
        for users, pos_items, neg_items in loader:
            users, pos_items, neg_items = users.to(device), pos_items.to(device), neg_items.to(device)
            with th.autocast("cuda", dtype=th.float16):
                pos_scores = model(users, pos_items)
                neg_scores = model(users, neg_items)
                loss = -th.log(th.sigmoid(pos_scores - neg_scores) + 1e-10).mean()  # expect: AMP011
                reg = args.l2 * (model.gmf_user(users).float().pow(2).sum(-1).mean())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss + reg).backward()
            scaler.step(optimizer)
            scaler.update()
            total += loss.item()
        logger.info("bpr epoch %d loss %.4f", epoch, total / len(loader))


def train_mf_pure_half(args, meta, train_set):
    """Memory-saving mode for very large id spaces: weights and activations in fp16."""
    device = th.device("cuda")
    model = MatrixFactorization(meta.n_users, meta.n_items, args.dim).to(device)
    if args.pure_fp16:
        model = model.half()
    optimizer = th.optim.Adam(model.parameters(), lr=args.lr)  # expect: AMP011
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4)
    for epoch in range(args.epochs):
        for u, i, r in loader:
            u, i, r = u.to(device), i.to(device), r.to(device)
            pred = model(u, i)
            loss = F.mse_loss(pred.float(), r.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        logger.info("mf epoch %d rmse %.4f", epoch, math.sqrt(loss.item()))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", default="ckpt/retrieval")
    p.add_argument("--task", choices=["retrieval", "bpr", "mf"], default="retrieval")
    p.add_argument("--objective", choices=["inbatch", "sampled", "pointwise"], default="inbatch")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--l2", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--num-negatives", type=int, default=1024)
    p.add_argument("--max-grad-norm", type=float, default=5.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--pure-fp16", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = InteractionDataset(args.data_dir)
    if args.task == "retrieval":
        train_retrieval(args, data.meta, data.train, data.eval, data.item_index())
    elif args.task == "bpr":
        train_bpr(args, data.meta, data.pairwise())
    else:
        train_mf_pure_half(args, data.meta, data.ratings())
