"""CTR / CVR ranking model: Deep Interest Network attention over the user's
behaviour history, a small Behaviour Sequence Transformer over the same history,
and ESMM-style click / conversion towers.

Runs on CPU training nodes with bfloat16 autocast (AMX), no loss scaling.
"""
import argparse
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader

from recsys.data import ClickLogDataset, collate_sessions
from recsys.metrics import group_auc

logger = logging.getLogger("din")


@dataclass
class RankerConfig:
    n_items: int = 2_000_000
    n_cates: int = 10_000
    n_users: int = 5_000_000
    emb_dim: int = 32
    hist_len: int = 100
    attn_hidden: tuple = (80, 40)
    mlp_dims: tuple = (200, 80)
    bst_layers: int = 1
    bst_heads: int = 4
    tasks: tuple = ("ctr", "cvr")
    attention: str = "din"  # din | normalized | softmax


class Dice(nn.Module):
    """Data-adaptive activation from the DIN paper (batch statistics, no running stats)."""

    def __init__(self, dim):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(dim=0, keepdim=True)  # expect: AMP004
        var = x.var(dim=0, unbiased=False, keepdim=True)  # expect: AMP004
        p = torch.sigmoid((x - mean) / torch.sqrt(var + 1e-8))
        return p * x + (1.0 - p) * self.alpha * x


class DINAttention(nn.Module):
    def __init__(self, d, hidden=(80, 40), mode="din"):
        super().__init__()
        self.mode = mode
        self.mlp = nn.Sequential(
            nn.Linear(4 * d, hidden[0]), Dice(hidden[0]),
            nn.Linear(hidden[0], hidden[1]), Dice(hidden[1]),
            nn.Linear(hidden[1], 1),
        )

    def forward(self, query, keys, mask):
        B, T, D = keys.shape
        q = query.unsqueeze(1).expand(-1, T, -1)
        feats = torch.cat([q, keys, q - keys, q * keys], dim=-1).reshape(B * T, 4 * D)
        scores = self.mlp(feats).view(B, T)
        if self.mode == "softmax":
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            weights = torch.softmax(scores, dim=-1)
        else:
            weights = scores * mask
            if self.mode == "normalized":
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004
        return (weights.unsqueeze(-1) * keys).sum(dim=1)  # expect: AMP004


class BSTBlock(nn.Module):
    def __init__(self, d, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.scale = (d // heads) ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.LeakyReLU(), nn.Linear(4 * d, d))
        self.norm2 = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        attn = attn.masked_fill(~mask[:, None, None, :], torch.finfo(attn.dtype).min)
        attn = self.drop(attn.softmax(dim=-1))
        h = torch.matmul(attn, v).transpose(1, 2).reshape(B, T, D)
        x = self.norm1(x + self.drop(self.out(h)))
        return self.norm2(x + self.drop(self.ffn(x)))


class DINRanker(nn.Module):
    def __init__(self, cfg: RankerConfig):
        super().__init__()
        d = cfg.emb_dim
        self.item_emb = nn.Embedding(cfg.n_items, d, padding_idx=0)
        self.cate_emb = nn.Embedding(cfg.n_cates, d, padding_idx=0)
        self.user_emb = nn.Embedding(cfg.n_users, d)
        self.pos_emb = nn.Embedding(cfg.hist_len, 2 * d)
        self.hist_proj = nn.Linear(2 * d, 2 * d)
        self.seq_in = nn.Linear(2 * d, 2 * d)
        self.attention = DINAttention(2 * d, cfg.attn_hidden, cfg.attention)
        self.bst = nn.ModuleList([BSTBlock(2 * d, cfg.bst_heads) for _ in range(cfg.bst_layers)])
        layers, in_dim = [], d + 2 * d * 3
        for h in cfg.mlp_dims:
            layers += [nn.Linear(in_dim, h), nn.PReLU(h), nn.Dropout(0.1)]
            in_dim = h
        self.shared = nn.Sequential(*layers)
        self.towers = nn.ModuleDict({t: nn.Linear(in_dim, 1) for t in cfg.tasks})

    def forward(self, batch):
        target = torch.cat([self.item_emb(batch["item"]), self.cate_emb(batch["cate"])], dim=-1)
        hist_ids = batch["hist_items"]
        mask = hist_ids != 0
        hist = torch.cat([self.item_emb(hist_ids), self.cate_emb(batch["hist_cates"])], dim=-1)

        interest = self.attention(target, self.hist_proj(hist), mask)

        positions = torch.arange(hist.size(1), device=hist.device)
        h = self.seq_in(hist + self.pos_emb(positions))
        for blk in self.bst:
            h = blk(h, mask)
        valid = mask.unsqueeze(-1)
        summed = (h * valid).sum(dim=1)  # expect: AMP004
        seq_repr = summed / valid.sum(dim=1).clamp(min=1)

        z = self.shared(torch.cat([self.user_emb(batch["user"]), interest, seq_repr, target], dim=-1))
        return {t: tower(z).squeeze(-1) for t, tower in self.towers.items()}


MODELS = {"din_bst": DINRanker}


class ESMMLoss(nn.Module):
    """CTR loss on impressions + CTCVR loss (pCTR * pCVR) on impressions."""

    def __init__(self, ctcvr_weight=1.0):
        super().__init__()
        self.ctcvr_weight = ctcvr_weight
        self.bce_logits = nn.BCEWithLogitsLoss()

    def forward(self, logits, labels):
        ctr_loss = self.bce_logits(logits["ctr"], labels["click"])
        p_ctcvr = torch.sigmoid(logits["ctr"]) * torch.sigmoid(logits["cvr"])
        ctcvr_loss = F.binary_cross_entropy(p_ctcvr, labels["purchase"])  # expect: AMP003
        return ctr_loss + self.ctcvr_weight * ctcvr_loss, {"ctr": ctr_loss.item(), "ctcvr": ctcvr_loss.item()}


def train_one_epoch(model, criterion, loader, optimizers, args, epoch):
    model.train()
    t0, seen = time.time(), 0
    for step, batch in enumerate(loader):
        labels = {"click": batch.pop("click").float(), "purchase": batch.pop("purchase").float()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(batch)
            loss, parts = criterion(logits, labels)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for opt in optimizers:
            opt.step()
        seen += labels["click"].numel()
        if step % args.log_every == 0:
            ctr_mean = torch.sigmoid(logits["ctr"].detach().float()).mean().item()
            logger.info("ep %d step %d loss %.4f ctr %.4f ctcvr %.4f pctr %.4f (%.0f samples/s)", epoch, step,
                        loss.item(), parts["ctr"], parts["ctcvr"], ctr_mean, seen / (time.time() - t0))


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    scores, clicks, buys, users = [], [], [], []
    for batch in loader:
        click, buy = batch.pop("click"), batch.pop("purchase")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(batch)
        scores.append(torch.sigmoid(logits["ctr"].float()).numpy())
        clicks.append(click.numpy())
        buys.append(buy.numpy())
        users.append(batch["user"].numpy())
    s, c, u = np.concatenate(scores), np.concatenate(clicks), np.concatenate(users)
    return {"auc": roc_auc_score(c, s), "gauc": group_auc(u, c, s)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--model", default="din_bst", choices=list(MODELS))
    p.add_argument("--attention", default="din", choices=["din", "normalized", "softmax"])
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--emb-lr", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--out", default="models/din")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    cfg = RankerConfig(attention=args.attention)
    model = MODELS[args.model](cfg)
    emb_params = [p_ for n_, p_ in model.named_parameters() if n_.endswith("_emb.weight")]
    dense_params = [p_ for n_, p_ in model.named_parameters() if not n_.endswith("_emb.weight")]
    optimizers = [torch.optim.Adagrad(emb_params, lr=args.emb_lr, eps=1e-10),
                  torch.optim.Adam(dense_params, lr=args.lr)]
    criterion = ESMMLoss()

    train_loader = DataLoader(ClickLogDataset(args.train, cfg.hist_len), batch_size=args.batch_size,
                              num_workers=8, collate_fn=collate_sessions, persistent_workers=True)
    valid_loader = DataLoader(ClickLogDataset(args.valid, cfg.hist_len), batch_size=8192,
                              num_workers=8, collate_fn=collate_sessions)
    os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, optimizers, args, epoch)
        metrics = evaluate(model, valid_loader, args)
        logger.info("epoch %d auc %.5f gauc %.5f", epoch, metrics["auc"], metrics["gauc"])
        if metrics["auc"] > best_auc:
            best_auc = metrics["auc"]
            torch.save({"model": model.state_dict(), "cfg": cfg.__dict__}, os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
