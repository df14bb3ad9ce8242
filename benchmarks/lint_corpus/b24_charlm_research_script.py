"""Character-level transformer LM on a single text file -- quick research script.

    python b24_charlm_research_script.py --data input.txt --fp16 --qk-norm --max-iters 20000
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda import amp

parser = argparse.ArgumentParser()
parser.add_argument("--data", default="input.txt")
parser.add_argument("--out-dir", default="out-charlm")
parser.add_argument("--n-layer", type=int, default=6)
parser.add_argument("--n-head", type=int, default=6)
parser.add_argument("--n-embd", type=int, default=384)
parser.add_argument("--block-size", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--min-lr", type=float, default=1e-4)
parser.add_argument("--warmup-iters", type=int, default=100)
parser.add_argument("--max-iters", type=int, default=5000)
parser.add_argument("--eval-interval", type=int, default=250)
parser.add_argument("--eval-iters", type=int, default=200)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--pad-id", type=int, default=0, help="reserved id that must never be predicted")
parser.add_argument("--qk-norm", action="store_true")
parser.add_argument("--fp16", action="store_true")
parser.add_argument("--seed", type=int, default=1337)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout, qk_norm=False):
        super().__init__()
        self.n_head, self.n_embd, self.qk_norm = n_head, n_embd, qk_norm
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    @staticmethod
    def _rms(t, eps=1e-6):
        return t * torch.rsqrt((t * t).mean(-1, keepdim=True) + eps)  # expect: AMP004

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.qk_norm:
            q, k = self._rms(q), self._rms(k)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg.n_embd, cfg.n_head, cfg.block_size, cfg.dropout, cfg.qk_norm)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout)
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharLM(nn.Module):
    def __init__(self, vocab_size, cfg):
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def load_data(path):
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    chars = ["\0"] + sorted(set(text) - {"\0"})
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.int64)
    n = int(0.9 * len(data))
    return {"train": torch.from_numpy(data[:n]), "val": torch.from_numpy(data[n:])}, len(chars)


def get_batch(splits, split, args, device):
    data = splits[split]
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([data[i : i + args.block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + args.block_size] for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss(model, splits, args, device, ctx):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(splits, split, args, device)
            with ctx:
                logits = model(X)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def main():
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out_dir, exist_ok=True)
    splits, vocab_size = load_data(args.data)
    model = CharLM(vocab_size, args).to(device)
    if args.fp16:
        model = model.half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))  # expect: AMP011
    scaler = amp.GradScaler(enabled=args.fp16)  # expect: AMP009
    ctx = torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16) if device == "cuda" else nullcontext()
    best_val_loss = 1e9
    t0 = time.time()
    for it in range(args.max_iters + 1):
        lr = get_lr(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % args.eval_interval == 0:
            losses = estimate_loss(model, splits, args, device, ctx)
            print(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "args": vars(args), "iter": it}, os.path.join(args.out_dir, "ckpt.pt"))
        X, Y = get_batch(splits, "train", args, device)
        with ctx:
            logits = model(X)
            logits[:, :, args.pad_id] = -1e9  # expect: AMP007
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
        if it % args.log_interval == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {it}: loss {loss.item():.4f}, lr {lr:.2e}, time {dt * 1000:.1f}ms")
    print(f"best val loss {best_val_loss:.4f}")


if __name__ == "__main__":
    main()
