"""Unsupervised SimCSE with a momentum key queue and two auxiliary terms.

Dropout noise gives two views of every sentence; the InfoNCE objective pulls the two
views together.  A momentum copy of the encoder fills a queue of extra negatives
(ESimCSE), an AnglE-style angle term works on the complex split of the embedding and a
Barlow-style decorrelation term keeps the embedding dimensions from collapsing.
Mixed precision: fp16 autocast on CUDA with a GradScaler.
"""
import argparse
import math
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.d_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        ctx = (attn @ v).transpose(1, 2).reshape(b, t, -1)
        return self.out(ctx)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.attn = MultiHeadSelfAttention(d_model, n_heads, dropout)
        self.ln1 = nn.LayerNorm(d_model, eps=1e-12)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.ln2 = nn.LayerNorm(d_model, eps=1e-12)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        x = self.ln1(x + self.drop(self.attn(x, pad_mask)))
        return self.ln2(x + self.drop(self.ff(x)))


class SentenceEncoder(nn.Module):
    """Post-LN transformer, masked mean pooling and a tanh projection (the SimCSE MLP)."""

    def __init__(self, vocab_size, d_model=256, n_layers=4, n_heads=4, d_ff=1024,
                 max_len=64, proj_dim=256, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.pos = nn.Embedding(max_len, d_model)
        self.emb_ln = nn.LayerNorm(d_model, eps=1e-12)
        self.layers = nn.ModuleList(
            [EncoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(n_layers)]
        )
        self.dense = nn.Linear(d_model, proj_dim)

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.emb_ln(self.tok(input_ids) + self.pos(pos))
        pad = attention_mask == 0
        for layer in self.layers:
            h = layer(h, pad)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        return torch.tanh(self.dense(pooled))


def info_nce(z1, z2, queue, temperature):
    z1 = F.normalize(z1, dim=-1)
    z2 = F.normalize(z2, dim=-1)
    logits = z1 @ z2.t()
    if queue is not None:
        logits = torch.cat([logits, z1 @ queue.t()], dim=1)
    labels = torch.arange(z1.size(0), device=z1.device)
    return F.cross_entropy(logits / temperature, labels)


def angle_term(z1, z2):
    """Angle between the two views, each half of the embedding read as a complex number."""
    a_re, a_im = torch.chunk(z1, 2, dim=1)
    b_re, b_im = torch.chunk(z2, 2, dim=1)
    denom = b_re * b_re + b_im * b_im + 1e-8  # expect: AMP011
    re = (a_re * b_re + a_im * b_im) / denom
    im = (a_im * b_re - a_re * b_im) / denom
    angle = torch.atan2(im, re).abs().sum(dim=1) / z1.size(1)
    return angle.mean()


def decorrelation_term(z, lambd=5e-3):
    mu = z.mean(dim=0, dtype=torch.float32)
    std = z.std(dim=0)  # expect: AMP004
    zn = (z - mu) / (std + 1e-8)  # expect: AMP011
    c = (zn.t() @ zn) / z.size(0)
    on_diag = (torch.diagonal(c) - 1).pow(2).sum()
    off_diag = c.pow(2).sum() - torch.diagonal(c).pow(2).sum()
    return on_diag + lambd * off_diag


def pairwise_cosine(a, b):
    """Cosine similarity written out by hand; norm runs in fp32 under CUDA autocast."""
    a = a / (a.norm(dim=-1, keepdim=True) + 1e-8)
    b = b / (b.norm(dim=-1, keepdim=True) + 1e-8)
    return (a * b).sum(dim=-1)


def spearman(x, y):
    rx = np.argsort(np.argsort(x)).astype(np.float64)
    ry = np.argsort(np.argsort(y)).astype(np.float64)
    rx = (rx - rx.mean()) / (rx.std() + 1e-12)
    ry = (ry - ry.mean()) / (ry.std() + 1e-12)
    return float((rx * ry).mean())


@torch.no_grad()
def evaluate(model, sts_batches, device):
    model.eval()
    preds, gold = [], []
    for ids_a, mask_a, ids_b, mask_b, score in sts_batches:
        ea = model(ids_a.to(device), mask_a.to(device)).float()
        eb = model(ids_b.to(device), mask_b.to(device)).float()
        preds.append(F.cosine_similarity(ea, eb, dim=-1, eps=1e-8).cpu().numpy())
        gold.append(score.numpy())
    model.train()
    return spearman(np.concatenate(preds), np.concatenate(gold))


@torch.no_grad()
def momentum_update(key_encoder, model, m):
    for pk, pq in zip(key_encoder.parameters(), model.parameters()):
        pk.mul_(m).add_(pq.detach(), alpha=1.0 - m)


def make_batches(corpus, batch_size, max_len):
    random.shuffle(corpus)
    for i in range(0, len(corpus) - batch_size + 1, batch_size):
        chunk = corpus[i:i + batch_size]
        ids = torch.zeros(batch_size, max_len, dtype=torch.long)
        mask = torch.zeros(batch_size, max_len, dtype=torch.long)
        for j, toks in enumerate(chunk):
            toks = toks[:max_len]
            ids[j, :len(toks)] = torch.tensor(toks)
            mask[j, :len(toks)] = 1
        yield ids, mask


def train(args, corpus, sts_batches):
    device = torch.device("cuda")
    cfg = dict(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.layers,
               max_len=args.max_len, proj_dim=args.d_model)
    model = SentenceEncoder(**cfg).to(device)
    key_encoder = SentenceEncoder(**cfg).to(device)
    key_encoder.load_state_dict(model.state_dict())
    key_encoder.requires_grad_(False)

    no_decay = ("bias", "ln")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")
    queue = torch.zeros(0, args.d_model, device=device)

    step = 0
    best = -1.0
    for epoch in range(args.epochs):
        for ids, mask in make_batches(corpus, args.batch_size, args.max_len):
            ids, mask = ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                z1 = model(ids, mask)
                z2 = model(ids, mask)
                with torch.no_grad():
                    keys = key_encoder(ids, mask)
                loss = info_nce(z1, z2, queue if queue.numel() else None, args.temperature)
                loss = loss + args.angle_weight * angle_term(z1, z2)
                loss = loss + args.decor_weight * decorrelation_term(z1)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()

            momentum_update(key_encoder, model, args.momentum)
            with torch.no_grad():
                new_keys = F.normalize(keys, dim=-1)  # expect: AMP011
                queue = torch.cat([new_keys.float(), queue], dim=0)[: args.queue_size]

            step += 1
            if step % args.log_every == 0:
                with torch.no_grad():
                    align = pairwise_cosine(z1.detach().float(), z2.detach().float()).mean()
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} align {align.item():.3f}")
            if step % args.eval_every == 0:
                score = evaluate(model, sts_batches, device)
                if score > best:
                    best = score
                    torch.save(model.state_dict(), args.out)
                print(f"step {step} sts spearman {score:.4f} (best {best:.4f})")
    return best


def synthetic_corpus(n, vocab_size, max_len, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(rng.randrange(4, max_len))] for _ in range(n)]


def synthetic_sts(n_batches, batch_size, vocab_size, max_len):
    batches = []
    for _ in range(n_batches):
        ids_a = torch.randint(1, vocab_size, (batch_size, max_len))
        ids_b = torch.randint(1, vocab_size, (batch_size, max_len))
        mask = torch.ones(batch_size, max_len, dtype=torch.long)
        batches.append((ids_a, mask, ids_b, mask, torch.rand(batch_size) * 5.0))
    return batches


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--angle-weight", type=float, default=0.1)
    p.add_argument("--decor-weight", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.995)
    p.add_argument("--queue-size", type=int, default=256)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--out", default="simcse.pt")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    corpus = synthetic_corpus(10000, args.vocab_size, args.max_len)
    sts = synthetic_sts(8, 32, args.vocab_size, args.max_len)
    best = train(args, corpus, sts)
    print(f"best sts spearman {best:.4f}")


if __name__ == "__main__":
    main()
