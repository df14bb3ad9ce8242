"""Small character-level GPT on tinyshakespeare, nanoGPT style but in one file.

python char_gpt_train.py --dtype float16 --grad-accum 4
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--data-dir", default="data/shakespeare_char")
p.add_argument("--out-dir", default="out-char")
p.add_argument("--block-size", type=int, default=256)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--n-layer", type=int, default=6)
p.add_argument("--n-head", type=int, default=6)
p.add_argument("--n-embd", type=int, default=384)
p.add_argument("--dropout", type=float, default=0.2)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--max-iters", type=int, default=5000)
p.add_argument("--eval-interval", type=int, default=250)
p.add_argument("--eval-iters", type=int, default=200)
p.add_argument("--grad-accum", type=int, default=1)
p.add_argument("--grad-clip", type=float, default=1.0)
p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
args = p.parse_args()

device = "cuda"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
ctx = torch.amp.autocast(device_type="cuda", dtype=ptdtype)
torch.backends.cuda.matmul.allow_tf32 = True

train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")
vocab_size = 65


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.n_head = n_head
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, -1e9)  # expect: AMP007
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, args.n_embd)
        self.pos_emb = nn.Embedding(args.block_size, args.n_embd)
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(
            [Block(args.n_embd, args.n_head, args.block_size, args.dropout) for _ in range(args.n_layer)])
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.lm_head = nn.Linear(args.n_embd, vocab_size, bias=False)
        self.tok_emb.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


@torch.no_grad()
def estimate_loss(model):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


model = GPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
scaler = torch.cuda.amp.GradScaler(enabled=(args.dtype == "float16"))  # expect: AMP009

os.makedirs(args.out_dir, exist_ok=True)
best_val_loss = 1e9
X, Y = get_batch("train")
t0 = time.time()
for it in range(args.max_iters + 1):
    if it % args.eval_interval == 0:
        losses = estimate_loss(model)
        print(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            torch.save({"model": model.state_dict(), "iter": it, "args": vars(args)},
                       os.path.join(args.out_dir, "ckpt.pt"))

    for micro_step in range(args.grad_accum):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / args.grad_accum
            X, Y = get_batch("train")
            scaler.scale(loss).backward()  # expect: AMP008
    if args.grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scaler.step(optimizer)  # expect: AMP006
    optimizer.zero_grad(set_to_none=True)

    if it % 10 == 0:
        dt = time.time() - t0
        t0 = time.time()
        print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f}, time {dt * 1000:.1f}ms")
