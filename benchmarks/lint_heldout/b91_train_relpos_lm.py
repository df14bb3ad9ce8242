"""Decoder-only LM with clipped relative position representations (Shaw et al., 2018).

    python train_relpos_lm.py --train data/enwik8_train.bin --val data/enwik8_val.bin \
        --vocab 256 --block-size 512 --max-iters 100000
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class RelativeSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, max_rel=64, dropout=0.1):
        super().__init__()
        self.h = n_heads
        self.dk = d_model // n_heads
        self.max_rel = max_rel
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.rel_k = nn.Embedding(2 * max_rel + 1, self.dk)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.dk).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n, device=x.device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.max_rel, self.max_rel) + self.max_rel
        rk = self.rel_k(rel)
        scores = q @ k.transpose(-2, -1) + torch.einsum("bhqd,qkd->bhqk", q, rk)
        scores = scores / math.sqrt(self.dk)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        mask_value = -1e9 if scores.dtype == torch.float32 else -1e4
        scores = scores.masked_fill(causal, mask_value)
        attn = self.drop(scores.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, n, -1)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, d_model, n_heads, max_rel, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = RelativeSelfAttention(d_model, n_heads, max_rel, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class RelPosLM(nn.Module):
    def __init__(self, vocab, d_model=512, n_layers=12, n_heads=8, max_rel=64, max_len=512, dropout=0.1):
        super().__init__()
        self.max_len = max_len
        self.encoder = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, max_rel, dropout) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))

    def hidden_states(self, idx):
        x = self.encoder(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)

    def forward(self, idx):
        return F.linear(self.hidden_states(idx), self.encoder.weight, self.decoder_bias)


def get_batch(data, block_size, batch_size, device):
    ix = np.random.randint(0, len(data) - block_size - 1, size=batch_size)
    x = torch.from_numpy(np.stack([data[i:i + block_size] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64))
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def evaluate(model, data, criterion, args, device, iters=100):
    model.eval()
    losses = torch.zeros(iters)
    for k in range(iters):
        x, y = get_batch(data, args.block_size, args.batch_size, device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            output = model(x)
            loss = criterion(output.view(-1, output.size(-1)), y.view(-1))
        losses[k] = loss.item()
    model.train()
    return losses.mean().item()


@torch.no_grad()
def sample(model, prompt, steps, temperature=1.0, top_k=40):
    model.eval()
    idx = prompt
    for _ in range(steps):
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            h = model.hidden_states(idx[:, -model.max_len:])
            logits = F.linear(h[:, -1, :], model.encoder.weight, model.decoder_bias) / temperature
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -1e10)  # expect: AMP007
        probs = F.softmax(logits.float(), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, num_samples=1)], dim=1)
    model.train()
    return idx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--max-rel", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=22)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    ap.add_argument("--clip", type=float, default=0.25)
    ap.add_argument("--max-iters", type=int, default=100000)
    ap.add_argument("--eval-interval", type=int, default=2000)
    ap.add_argument("--save-dir", default="checkpoints/relpos")
    args = ap.parse_args()

    device = torch.device("cuda")
    train_data = np.memmap(args.train, dtype=np.uint8, mode="r")
    val_data = np.memmap(args.val, dtype=np.uint8, mode="r")
    model = RelPosLM(args.vocab, args.d_model, args.layers, args.heads, args.max_rel, args.block_size).to(device)
    ntokens = args.vocab
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.max_iters, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    os.makedirs(args.save_dir, exist_ok=True)
    best_val = float("inf")
    t0 = time.time()
    for it in range(1, args.max_iters + 1):
        x, y = get_batch(train_data, args.block_size, args.batch_size, device)
        with torch.cuda.amp.autocast():  # expect: AMP009
            output = model(x).view(-1, ntokens)
        loss = criterion(output, y.view(-1))  # expect: AMP002

        optimizer.zero_grad()
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if it % 200 == 0:
            elapsed = time.time() - t0
            print(f"it {it} | loss {loss.item():.4f} | bpc {loss.item() / math.log(2):.3f} | {elapsed:.0f}s")
        if it % args.eval_interval == 0:
            val_loss = evaluate(model, val_data, criterion, args, device)
            print(f"it {it} | val loss {val_loss:.4f} | val bpc {val_loss / math.log(2):.3f}")
            if val_loss < best_val:
                best_val = val_loss
                torch.save(model.state_dict(), os.path.join(args.save_dir, "best.pt"))
            prompt = torch.from_numpy(val_data[:64].astype(np.int64))[None].to(device)
            text = bytes(sample(model, prompt, 200)[0, 64:].tolist()).decode("utf8", errors="replace")
            print(text)


if __name__ == "__main__":
    main()
