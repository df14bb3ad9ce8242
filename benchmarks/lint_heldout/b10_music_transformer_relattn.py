"""Music Transformer (Huang et al. 2018) on MAESTRO event sequences.

Relative global attention with the memory-efficient "skewing" trick, label-smoothed
cross entropy, and a style fine-tuning entry point for single-composer subsets.
"""
import argparse
import math
import os
import random
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD_TOKEN = 388
VOCAB_SIZE = 390
TOKEN_END = 389


def get_autocast(precision, device_type="cuda"):
    if precision == "fp16":
        return torch.autocast(device_type, dtype=torch.float16)
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


class RelativeGlobalAttention(nn.Module):
    def __init__(self, d_model=512, n_heads=8, max_seq=2048, dropout=0.1):
        super().__init__()
        self.h, self.dh, self.max_seq = n_heads, d_model // n_heads, max_seq
        self.Wq = nn.Linear(d_model, d_model)
        self.Wk = nn.Linear(d_model, d_model)
        self.Wv = nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, d_model)
        self.E = nn.Parameter(torch.randn(max_seq, self.dh))
        self.drop = nn.Dropout(dropout)

    @staticmethod
    def _skewing(t):
        padded = F.pad(t, (1, 0))
        srel = padded.reshape(-1, padded.shape[-1] + 1, padded.shape[-2])[:, 1:, :]
        return srel.reshape(t.shape)

    def _split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.h, self.dh).transpose(1, 2)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self._split(self.Wq(x)), self._split(self.Wk(x)), self._split(self.Wv(x))
        e = self.E[self.max_seq - n:, :]
        qe = torch.einsum("bhld,md->bhlm", q, e)
        qe = qe.masked_fill(torch.ones_like(qe[0, 0], dtype=torch.bool).tril().flip(1).logical_not(), 0)
        srel = self._skewing(qe).reshape(b, self.h, n, n)
        logits = (q @ k.transpose(-1, -2) + srel) / math.sqrt(self.dh)
        if mask is not None:
            logits = logits.masked_fill(mask, -1e9)  # expect: AMP007
        attn = self.drop(F.softmax(logits, dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, n, d)
        return self.fc(out)


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, max_seq, dropout=0.1):
        super().__init__()
        self.rga = RelativeGlobalAttention(d_model, n_heads, max_seq, dropout)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))
        self.ln1 = nn.LayerNorm(d_model, eps=1e-6)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-6)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = self.ln1(x + self.drop(self.rga(x, mask)))
        return self.ln2(x + self.drop(self.ffn(x)))


class MusicTransformer(nn.Module):
    def __init__(self, d_model=512, n_layers=6, n_heads=8, d_ff=1024, max_seq=2048, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(VOCAB_SIZE, d_model, padding_idx=PAD_TOKEN)
        self.pos = nn.Parameter(torch.zeros(1, max_seq, d_model))
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads, d_ff, max_seq, dropout) for _ in range(n_layers))
        self.fc = nn.Linear(d_model, VOCAB_SIZE)

    @staticmethod
    def causal_mask(tokens):
        n = tokens.shape[1]
        look_ahead = torch.triu(torch.ones(n, n, dtype=torch.bool, device=tokens.device), diagonal=1)
        pad = (tokens == PAD_TOKEN)[:, None, None, :]
        return look_ahead[None, None] | pad

    def forward(self, tokens):
        mask = self.causal_mask(tokens)
        x = self.embedding(tokens) * math.sqrt(self.d_model) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, mask)
        return self.fc(x)

    @torch.no_grad()
    def generate(self, primer, length=1024, top_k=32, temperature=1.0):
        self.eval()
        seq = primer
        for _ in range(length):
            logits = self(seq[:, -self.pos.shape[1]:])[:, -1, :] / temperature
            v, _ = torch.topk(logits, top_k)
            logits[logits < v[:, [-1]]] = float("-inf")
            nxt = torch.multinomial(F.softmax(logits.float(), dim=-1), 1)
            seq = torch.cat([seq, nxt], dim=1)
            if nxt.item() == TOKEN_END:
                break
        return seq


class SmoothCrossEntropyLoss(nn.Module):
    """Label-smoothed cross entropy that ignores PAD (from the reference implementation)."""

    def __init__(self, label_smoothing, vocab_size, ignore_index=-100):
        super().__init__()
        self.label_smoothing, self.vocab_size, self.ignore_index = label_smoothing, vocab_size, ignore_index

    def forward(self, input, target):
        mask = (target == self.ignore_index).unsqueeze(-1)
        q = F.one_hot(target.long(), self.vocab_size).float()
        u = 1.0 / self.vocab_size
        q_prime = ((1.0 - self.label_smoothing) * q + self.label_smoothing * u).masked_fill(mask, 0)
        ce = (q_prime * (input - input.logsumexp(dim=-1, keepdim=True))).sum(dim=-1)
        lengths = torch.sum(target != self.ignore_index)
        return -ce.sum() / lengths


def load_split(data_dir, split, max_seq):
    seqs = torch.load(os.path.join(data_dir, f"{split}.pt"))
    out = []
    for s in seqs:
        s = s[: max_seq + 1]
        out.append(F.pad(s, (0, max_seq + 1 - len(s)), value=PAD_TOKEN))
    return torch.stack(out)


def batches(data, batch_size, shuffle=True):
    idx = list(range(len(data)))
    if shuffle:
        random.shuffle(idx)
    for i in range(0, len(idx) - batch_size + 1, batch_size):
        b = data[idx[i:i + batch_size]]
        yield b[:, :-1], b[:, 1:]


def train(args):
    device = torch.device("cuda")
    model = MusicTransformer(max_seq=args.max_seq).to(device)
    criterion = SmoothCrossEntropyLoss(0.1, VOCAB_SIZE, ignore_index=PAD_TOKEN)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) ** -0.5, (s + 1) * args.warmup ** -1.5) * args.warmup ** 0.5)
    amp_ctx = get_autocast(args.precision)
    scaler = torch.amp.GradScaler("cuda") if args.precision == "fp16" else None
    train_data = load_split(args.data_dir, "train", args.max_seq)
    val_data = load_split(args.data_dir, "val", args.max_seq)

    step, best_val = 0, float("inf")
    for epoch in range(args.epochs):
        model.train()
        for x, tgt in batches(train_data, args.batch_size):
            x, tgt = x.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with amp_ctx:
                logits = model(x)
            loss = criterion(logits, tgt)  # expect: AMP002
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
            lr_scheduler.step()
            step += 1
            if step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {lr_scheduler.get_last_lr()[0]:.2e}")

        val = evaluate(model, val_data, args, device)
        if val < best_val:
            best_val = val
            torch.save({"model": model.state_dict(), "step": step, "val": val}, os.path.join(args.out_dir, "best.pt"))


@torch.no_grad()
def evaluate(model, data, args, device):
    model.eval()
    total, n = 0.0, 0
    for x, tgt in batches(data, args.batch_size, shuffle=False):
        x, tgt = x.to(device), tgt.to(device)
        with get_autocast(args.precision):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tgt.reshape(-1), ignore_index=PAD_TOKEN)
        total, n = total + loss.item(), n + 1
    return total / max(n, 1)


def finetune_style(args, composer):
    """Short fine-tune on one composer's pieces, starting from the best MAESTRO checkpoint."""
    device = torch.device("cuda")
    model = MusicTransformer(max_seq=args.max_seq).to(device)
    model.load_state_dict(torch.load(os.path.join(args.out_dir, "best.pt"), map_location="cpu")["model"])
    for p in model.embedding.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr * 0.1)
    match args.precision:
        case "fp16":
            ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        case "bf16":
            ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case _:
            ctx = nullcontext()
    data = load_split(os.path.join(args.data_dir, "composers", composer), "train", args.max_seq)
    model.train()
    for epoch in range(args.finetune_epochs):
        for x, tgt in batches(data, args.batch_size):
            x, tgt = x.to(device), tgt.to(device)
            with ctx:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tgt.reshape(-1), ignore_index=PAD_TOKEN,
                                       label_smoothing=0.1)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    torch.save(model.state_dict(), os.path.join(args.out_dir, f"style_{composer}.pt"))
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="data/maestro_events")
    parser.add_argument("--out_dir", default="runs/music_transformer")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_seq", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--composer", default=None)
    parser.add_argument("--finetune_epochs", type=int, default=5)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.composer:
        finetune_style(args, args.composer)
    else:
        train(args)
