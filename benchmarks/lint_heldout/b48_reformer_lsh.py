"""Reformer language model with shared-QK LSH attention (Kitaev et al., 2020).

Character-level enwik8 training. `--fp16` turns on the "fast" mode: half-precision
weights plus autocast and loss scaling.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LSHAttention(nn.Module):
    def __init__(self, dim, heads=8, bucket_size=64, n_hashes=4, causal=True, dropout=0.0):
        super().__init__()
        self.heads, self.dim_head = heads, dim // heads
        self.bucket_size, self.n_hashes, self.causal = bucket_size, n_hashes, causal
        self.to_qk = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def hash_vectors(self, n_buckets, vecs):
        b, t, d = vecs.shape
        rot_shape = (1, d, self.n_hashes, n_buckets // 2)
        rotations = torch.randn(rot_shape, device=vecs.device, dtype=vecs.dtype).expand(b, -1, -1, -1)
        rotated = torch.einsum("btf,bfhi->bhti", vecs, rotations)
        rotated = torch.cat([rotated, -rotated], dim=-1)
        buckets = torch.argmax(rotated, dim=-1)
        offsets = (torch.arange(self.n_hashes, device=vecs.device) * n_buckets).reshape(1, -1, 1)
        return (buckets + offsets).reshape(b, -1)

    def lsh(self, qk, v):
        b, t, d = qk.shape
        n_buckets = t // self.bucket_size
        buckets = self.hash_vectors(n_buckets, qk)
        ticker = torch.arange(self.n_hashes * t, device=qk.device).unsqueeze(0).expand_as(buckets)
        buckets_and_t = t * buckets + (ticker % t)
        _, sticker = buckets_and_t.sort(dim=-1)
        _, undo_sort = sticker.sort(dim=-1)
        st = sticker % t
        sqk = qk.gather(1, st.unsqueeze(-1).expand(-1, -1, d))
        sv = v.gather(1, st.unsqueeze(-1).expand(-1, -1, d))
        n_chunks = self.n_hashes * n_buckets
        bq_t = bkv_t = st.reshape(b, n_chunks, -1)
        bqk = sqk.reshape(b, n_chunks, -1, d)
        bv = sv.reshape(b, n_chunks, -1, d)
        bq = bqk
        bk = F.normalize(bqk, p=2, dim=-1)
        look_one_back = lambda x: torch.cat([x, torch.cat([x[:, -1:], x[:, :-1]], dim=1)], dim=2)
        bk, bv, bkv_t = look_one_back(bk), look_one_back(bv), look_one_back(bkv_t)
        dots = torch.einsum("bhie,bhje->bhij", bq, bk) * (d ** -0.5)
        if self.causal:
            causal = bq_t[:, :, :, None] < bkv_t[:, :, None, :]
            dots.masked_fill_(causal, torch.finfo(dots.dtype).min)
        # a token may attend to itself only when nothing else is available
        self_mask = bq_t[:, :, :, None] == bkv_t[:, :, None, :]
        dots.masked_fill_(self_mask, -1e5)  # expect: AMP007
        dots_lse = torch.logsumexp(dots, dim=-1, keepdim=True)
        dots = self.dropout(torch.exp(dots - dots_lse))
        bo = torch.einsum("buij,buje->buie", dots, bv)
        so = bo.reshape(b, -1, d)
        slogits = dots_lse.reshape(b, -1)
        o = so.gather(1, undo_sort.unsqueeze(-1).expand(-1, -1, d))
        logits = slogits.gather(1, undo_sort)
        o = o.reshape(b, self.n_hashes, t, d)
        logits = logits.reshape(b, self.n_hashes, t, 1)
        probs = torch.exp(logits - torch.logsumexp(logits, dim=1, keepdim=True))
        return torch.sum(o * probs, dim=1)

    def forward(self, x):
        b, t, _ = x.shape
        qk, v = self.to_qk(x), self.to_v(x)
        merge = lambda y: y.reshape(b, t, self.heads, self.dim_head).transpose(1, 2).reshape(b * self.heads, t, -1)
        out = self.lsh(merge(qk), merge(v))
        out = out.reshape(b, self.heads, t, self.dim_head).transpose(1, 2).reshape(b, t, -1)
        return self.to_out(out)


class ChunkedFeedForward(nn.Module):
    """NormFormer-style FFN: an extra normalisation after the activation, chunked over time."""

    def __init__(self, dim, mult=4, chunks=8):
        super().__init__()
        self.w1 = nn.Linear(dim, dim * mult)
        self.w2 = nn.Linear(dim * mult, dim)
        self.g = nn.Parameter(torch.ones(dim * mult))
        self.chunks = chunks

    def _ff(self, x):
        h = F.gelu(self.w1(x))
        mu = h.mean(-1, keepdim=True)  # expect: AMP004
        var = h.var(-1, unbiased=False, keepdim=True)  # expect: AMP004
        h = (h - mu) / torch.sqrt(var + 1e-12) * self.g  # expect: AMP011
        return self.w2(h)

    def forward(self, x):
        return torch.cat([self._ff(c) for c in x.chunk(self.chunks, dim=1)], dim=1)


class ReformerBlock(nn.Module):
    def __init__(self, dim, heads, bucket_size, n_hashes):
        super().__init__()
        self.norm_attn = nn.LayerNorm(dim)
        self.attn = LSHAttention(dim, heads, bucket_size, n_hashes)
        self.norm_ff = nn.LayerNorm(dim)
        self.ff = ChunkedFeedForward(dim)

    def forward(self, x):
        x = x + self.attn(self.norm_attn(x))
        return x + self.ff(self.norm_ff(x))


class ReformerLM(nn.Module):
    def __init__(self, num_tokens=256, dim=512, depth=6, max_seq_len=4096, heads=8, bucket_size=64, n_hashes=4):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(ReformerBlock(dim, heads, bucket_size, n_hashes) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.token_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(self.norm(x))


def train(model, loader, optimizer, scaler, scheduler, args):
    model.train()
    for step, batch in enumerate(loader):
        batch = batch.cuda(non_blocking=True)
        inp, tgt = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            logits = model(inp)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} bpc {loss.item() / math.log(2):.3f}")
        if step >= args.steps:
            break


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        batch = batch.cuda()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        total += loss.item()
        count += 1
    model.train()
    return total / max(count, 1) / math.log(2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=100000)
    args = p.parse_args()
    model = ReformerLM().cuda()
    if args.fp16:
        model.half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4000))
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
    train_loader = val_loader = []  # enwik8 loaders from data.py
    train(model, train_loader, optimizer, scaler, scheduler, args)
    print("val bpc", evaluate(model, val_loader, args))


if __name__ == "__main__":
    main()
