"""Two-tower retrieval model with in-batch negatives and logQ correction, plus ESMM
CTR / CVR heads trained jointly (multi-task).  Item sampling probabilities are estimated online
with the streaming frequency estimator of Yi et al. (RecSys 2019).
"""
import argparse
import functools
import math
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

TwoTowerOutput = namedtuple("TwoTowerOutput", ["q", "i", "ctr_logit", "cvr_logit"])


def mlp(dims, dropout=0.1):
    layers = []
    for d_in, d_out in zip(dims[:-2], dims[1:-1]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU(inplace=True), nn.Dropout(dropout)]
    layers.append(nn.Linear(dims[-2], dims[-1]))
    return nn.Sequential(*layers)


class SparseFeatures(nn.Module):
    """One EmbeddingBag per categorical field; outputs stay fp32 (embedding is not autocast)."""

    def __init__(self, fields, dim):
        super().__init__()
        self.bags = nn.ModuleDict({name: nn.EmbeddingBag(card, dim, mode="sum") for name, card in fields.items()})

    def forward(self, feats):
        pooled = {name: bag(feats[name][0], feats[name][1]) for name, bag in self.bags.items()}
        return torch.cat([pooled[k] for k in sorted(pooled)], dim=-1)


class HistoryPooling(nn.Module):
    def __init__(self, n_items, dim):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, dim, padding_idx=0)

    def forward(self, hist_ids):
        mask = (hist_ids > 0).float().unsqueeze(-1)
        e = self.item_emb(hist_ids)
        return (e * mask).sum(1) / mask.sum(1).clamp(min=1.0)


class Tower(nn.Module):
    def __init__(self, d_in, hidden, d_out, standardize=False):
        super().__init__()
        self.mlp = mlp([d_in, *hidden, d_out])
        self.standardize = standardize

    def forward(self, x):
        h = self.mlp(x)
        if self.standardize:
            # batch standardisation to keep the embedding space from collapsing
            mu = h.mean(dim=0, keepdim=True)  # expect: AMP004
            sd = h.std(dim=0, keepdim=True)  # expect: AMP004
            h = (h - mu) / (sd + 1e-8)  # expect: AMP011
        # F.normalize runs in fp32 under CUDA autocast: its eps=1e-12 is fine
        return F.normalize(h, dim=-1)


class TwoTower(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["emb_dim"]
        self.user_sparse = SparseFeatures(cfg["user_fields"], d)
        self.item_sparse = SparseFeatures(cfg["item_fields"], d)
        self.history = HistoryPooling(cfg["n_items"], d)
        d_user = d * (len(cfg["user_fields"]) + 1) + cfg["n_dense"]
        d_item = d * len(cfg["item_fields"])
        self.query_tower = Tower(d_user, cfg["hidden"], cfg["out_dim"], standardize=cfg["standardize"])
        self.item_tower = Tower(d_item, cfg["hidden"], cfg["out_dim"], standardize=cfg["standardize"])
        self.ctr_head = mlp([2 * cfg["out_dim"], 128, 1])
        self.cvr_head = mlp([2 * cfg["out_dim"], 128, 1])

    def forward(self, batch):
        u = torch.cat([self.user_sparse(batch["user"]), self.history(batch["hist"]), batch["dense"]], dim=-1)
        q = self.query_tower(u)
        i = self.item_tower(self.item_sparse(batch["item"]))
        qi = torch.cat([q, i], dim=-1)
        return TwoTowerOutput(q, i, self.ctr_head(qi).squeeze(-1), self.cvr_head(qi).squeeze(-1))


class StreamingFrequency(nn.Module):
    """Estimates the sampling probability of each item from the gap between its hits."""

    def __init__(self, n_buckets=2 ** 22, alpha=0.01):
        super().__init__()
        self.n_buckets, self.alpha = n_buckets, alpha
        self.register_buffer("last_step", torch.zeros(n_buckets, dtype=torch.long))
        self.register_buffer("delta", torch.ones(n_buckets))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, item_ids):
        h = item_ids % self.n_buckets
        gap = (self.step - self.last_step[h]).float()
        self.delta[h] = (1 - self.alpha) * self.delta[h] + self.alpha * gap
        self.last_step[h] = self.step
        self.step += 1

    def log_q(self, item_ids):
        prob = 1.0 / self.delta[item_ids % self.n_buckets]
        return torch.log(prob + 1e-10)  # fp32 buffer


def build_model(cfg):
    return TwoTower(cfg), StreamingFrequency()


def in_batch_softmax_loss(q, i, item_ids, log_q, temperature):
    logits = q @ i.T / temperature
    logits = logits - log_q.unsqueeze(0)  # logQ correction (fp32 vector: promotes)
    same = item_ids.unsqueeze(0) == item_ids.unsqueeze(1)
    eye = torch.eye(len(item_ids), dtype=torch.bool, device=logits.device)
    logits = logits.masked_fill(same & ~eye, torch.finfo(logits.dtype).min)
    labels = torch.arange(len(item_ids), device=logits.device)
    return F.cross_entropy(logits, labels)


amp_autocast = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16)


def train(cfg, loader, epochs, device="cuda"):
    model, freq = build_model(cfg)
    model, freq = model.to(device), freq.to(device)
    sparse_params = [p for n, p in model.named_parameters() if "bags" in n or "item_emb" in n]
    dense_params = [p for n, p in model.named_parameters() if not ("bags" in n or "item_emb" in n)]
    dense_opt = torch.optim.AdamW(dense_params, lr=cfg["lr"], weight_decay=1e-6)
    sparse_opt = torch.optim.Adagrad(sparse_params, lr=0.05, eps=1e-10)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        model.train()
        for step, batch in enumerate(loader):
            batch = to_device(batch, device)
            freq.update(batch["item_id"])
            with amp_autocast():
                out = model(batch)
                retrieval = in_batch_softmax_loss(out.q, out.i, batch["item_id"], freq.log_q(batch["item_id"]), cfg["temperature"])
                ctr_prob = torch.sigmoid(out.ctr_logit)
                ctr = F.binary_cross_entropy(ctr_prob, batch["click"].float())  # expect: AMP003
                # ESMM: pCTCVR = pCTR * pCVR, supervised on the whole impression space
                ctcvr_prob = ctr_prob * torch.sigmoid(out.cvr_logit)
                conv = batch["conversion"].float()
                pos = conv * torch.log(ctcvr_prob + 1e-10)  # expect: AMP011
                neg = (1.0 - conv) * torch.log(1.0 - ctcvr_prob + 1e-10)  # expect: AMP011
                ctcvr = -(pos + neg).mean()
                loss = retrieval + cfg["ctr_weight"] * (ctr + ctcvr)
            dense_opt.zero_grad(set_to_none=True)
            sparse_opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(dense_opt)
            sparse_opt.step()  # expect: AMP006
            scaler.update()
            if step % 500 == 0:
                print(f"epoch {epoch} step {step} retrieval {retrieval.item():.4f} ctr {ctr.item():.4f} ctcvr {ctcvr.item():.4f}")
    return model


def to_device(batch, device):
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch.to(device, non_blocking=True)


@torch.no_grad()
def evaluate_recall(model, user_loader, item_loader, k=100, device="cuda"):
    model.eval()
    with amp_autocast():
        items = torch.cat([model.item_tower(model.item_sparse(to_device(b, device)["item"])) for b in item_loader])
        hits, n = 0.0, 0
        for b in user_loader:
            b = to_device(b, device)
            u = torch.cat([model.user_sparse(b["user"]), model.history(b["hist"]), b["dense"]], dim=-1)
            scores = model.query_tower(u) @ items.T
            mean_score = scores.mean()
            topk = scores.topk(k, dim=-1).indices
            hits += (topk == b["target_idx"].unsqueeze(-1)).any(-1).float().sum().item()
            n += scores.size(0)
    print(f"mean score {mean_score.item():.3f}")
    return hits / max(n, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    cfg = dict(emb_dim=32, n_items=2_000_000, n_dense=16, hidden=[512, 256], out_dim=64,
               standardize=True, lr=1e-3, temperature=0.05, ctr_weight=0.5,
               user_fields={"country": 250, "device": 40, "age_bucket": 12},
               item_fields={"category": 5000, "brand": 40000, "item": 2_000_000})
    model = train(cfg, DataLoader([]), args.epochs)
    recall = evaluate_recall(model, DataLoader([]), DataLoader([]))
    print("recall@100", np.round(recall, 4), "log-temp", math.log(cfg["temperature"]))


if __name__ == "__main__":
    main()
