"""Dual-encoder retrieval fine-tuning with in-batch negatives and configurable pooling
(cls / mean / max / learned attention pooling).

    python dense_retrieval_pooling.py --model bert-base-uncased --train data/train_pairs.tsv \
        --dev data/dev_pairs.tsv --pooling attn --batch-size 128 --epochs 3
"""
import argparse
import csv
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


class PairDataset(Dataset):
    def __init__(self, path, max_pairs=None):
        with open(path, newline="", encoding="utf8") as f:
            rows = [(r[0], r[1]) for r in csv.reader(f, delimiter="\t") if len(r) >= 2]
        random.Random(13).shuffle(rows)
        self.pairs = rows[:max_pairs] if max_pairs else rows

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def make_collate(tokenizer, q_len, d_len):
    def collate(batch):
        queries, docs = zip(*batch)
        q = tokenizer(list(queries), padding=True, truncation=True, max_length=q_len, return_tensors="pt")
        d = tokenizer(list(docs), padding=True, truncation=True, max_length=d_len, return_tensors="pt")
        return q, d

    return collate


def pool(hidden, attention_mask, mode="mean", query=None):
    if mode == "cls":
        return hidden[:, 0]
    if mode == "mean":
        m = attention_mask.unsqueeze(-1).float()
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if mode == "max":
        neg = torch.finfo(hidden.dtype).min
        return hidden.masked_fill(attention_mask.unsqueeze(-1) == 0, neg).max(dim=1).values
    if mode == "attn":
        scores = torch.einsum("bnd,d->bn", hidden, query) / math.sqrt(hidden.size(-1))
        scores = scores.masked_fill(attention_mask == 0, -1e9)  # expect: AMP007
        weights = scores.softmax(dim=-1)
        return torch.einsum("bn,bnd->bd", weights, hidden)
    raise ValueError(f"unknown pooling mode {mode!r}")


@torch.no_grad()
def evaluate(encoder, pool_query, dev_pairs, tokenizer, args, device):
    encoder.eval()
    q_embs, d_embs = [], []
    for i in range(0, len(dev_pairs), 256):
        chunk = dev_pairs[i:i + 256]
        q = tokenizer([c[0] for c in chunk], padding=True, truncation=True,
                      max_length=args.q_len, return_tensors="pt").to(device)
        d = tokenizer([c[1] for c in chunk], padding=True, truncation=True,
                      max_length=args.d_len, return_tensors="pt").to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            qh = encoder(**q).last_hidden_state
            dh = encoder(**d).last_hidden_state
            q_embs.append(pool(qh, q["attention_mask"], args.pooling, pool_query).float())
            d_embs.append(pool(dh, d["attention_mask"], args.pooling, pool_query).float())
    queries = F.normalize(torch.cat(q_embs), dim=-1)
    docs = F.normalize(torch.cat(d_embs), dim=-1)
    scores = queries @ docs.t()
    ranks = (scores > scores.diagonal()[:, None]).sum(dim=1)
    encoder.train()
    return {f"R@{k}": (ranks < k).float().mean().item() for k in (1, 5, 20)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--pooling", choices=["cls", "mean", "max", "attn"], default="mean")
    ap.add_argument("--q-len", type=int, default=32)
    ap.add_argument("--d-len", type=int, default=180)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--scale", type=float, default=20.0)
    ap.add_argument("--margin", type=float, default=0.5)
    ap.add_argument("--pointwise-weight", type=float, default=0.1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--out", default="out/dual_encoder")
    args = ap.parse_args()

    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoder = AutoModel.from_pretrained(args.model).to(device)
    pool_query = nn.Parameter(torch.randn(encoder.config.hidden_size, device=device) * 0.02)

    train_ds = PairDataset(args.train)
    dev_pairs = PairDataset(args.dev, max_pairs=5000).pairs
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=4, collate_fn=make_collate(tokenizer, args.q_len, args.d_len))

    params = [p for p in encoder.parameters() if p.requires_grad] + [pool_query]
    optimizer = torch.optim.AdamW(
        [{"params": list(encoder.parameters())}, {"params": [pool_query], "lr": args.lr * 10}],
        lr=args.lr, weight_decay=0.01, eps=1e-8,
    )
    total = args.epochs * len(loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.06 * total), total)
    scaler = torch.amp.GradScaler("cuda")

    step = 0
    for epoch in range(args.epochs):
        for q_batch, d_batch in loader:
            q_batch = {k: v.to(device, non_blocking=True) for k, v in q_batch.items()}
            d_batch = {k: v.to(device, non_blocking=True) for k, v in d_batch.items()}

            with torch.autocast(device_type="cuda", dtype=torch.float16):
                q_hidden = encoder(**q_batch).last_hidden_state
                d_hidden = encoder(**d_batch).last_hidden_state
                q_emb = F.normalize(pool(q_hidden, q_batch["attention_mask"], args.pooling, pool_query), dim=-1)
                d_emb = F.normalize(pool(d_hidden, d_batch["attention_mask"], args.pooling, pool_query), dim=-1)
                q2d = q_emb @ d_emb.t() * args.scale
                d2q = d_emb @ q_emb.t() * args.scale
                labels = torch.arange(q2d.size(0), device=device)
                loss_fwd = F.cross_entropy(q2d, labels)
                # pointwise term pushes every positive above the margin, not just above the negatives
                pos_prob = torch.sigmoid(q2d.diagonal() - args.scale * args.margin)
                pointwise = -torch.log(pos_prob + 1e-8).mean()  # expect: AMP011
                if step % args.log_every == 0:
                    score_std = q2d.std().item()  # expect: AMP004
            loss_bwd = F.cross_entropy(d2q, labels)  # expect: AMP002
            loss = 0.5 * (loss_fwd + loss_bwd) + args.pointwise_weight * pointwise

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            if step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"pointwise {pointwise.item():.4f} score std {score_std:.3f}")
            step += 1

        metrics = evaluate(encoder, pool_query, dev_pairs, tokenizer, args, device)
        print(f"epoch {epoch} dev " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        encoder.save_pretrained(f"{args.out}/epoch_{epoch}")
        torch.save({"pool_query": pool_query.detach().cpu(), "pooling": args.pooling},
                   f"{args.out}/epoch_{epoch}/pooling.pt")


if __name__ == "__main__":
    main()
