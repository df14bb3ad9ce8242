"""BERT-base masked-LM pretraining on pre-tokenised shards.

The MLM decoder only runs on the masked positions (about 15% of 512 tokens), which saves
most of the vocab projection.
"""
import argparse
import functools
import glob
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class BertSelfAttention(nn.Module):
    def __init__(self, hidden, heads, dropout=0.1):
        super().__init__()
        self.h, self.d = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.h, self.d).transpose(1, 2)

    def forward(self, x, attention_mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, -1e8)  # expect: AMP007
        probs = self.dropout(F.softmax(scores, dim=-1))
        return torch.matmul(probs, v).transpose(1, 2).flatten(2)


class BertLayer(nn.Module):
    def __init__(self, hidden=768, heads=12, inter=3072, dropout=0.1):
        super().__init__()
        self.attn = BertSelfAttention(hidden, heads, dropout)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(hidden, inter), nn.GELU(), nn.Linear(inter, hidden))
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, attention_mask):
        x = self.ln1(x + self.drop(self.attn_out(self.attn(x, attention_mask))))
        return self.ln2(x + self.drop(self.ffn(x)))


class BertForPretraining(nn.Module):
    def __init__(self, vocab_size=30522, hidden=768, layers=12, max_pos=512):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.emb_ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList([BertLayer(hidden) for _ in range(layers)])
        self.transform = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=1e-12))
        self.mlm_bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, input_ids, token_type_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        x = self.emb_ln(x)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x


class ShardDataset(Dataset):
    def __init__(self, pattern):
        self.shards = [np.load(f, mmap_mode="r") for f in sorted(glob.glob(pattern))]
        self.index = [(s, i) for s, arr in enumerate(self.shards) for i in range(arr["input_ids"].shape[0])]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, j = self.index[i]
        arr = self.shards[s]
        return {k: torch.from_numpy(np.array(arr[k][j])).long()
                for k in ("input_ids", "token_type_ids", "attention_mask", "labels")}


def make_grad_scaler(enabled=True):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", default="data/bert_shards/*.npz")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--accum-steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    ap.add_argument("--clip-value", type=float, default=1.0)
    ap.add_argument("--out", default="ckpt/bert_base")
    args = ap.parse_args()

    device = torch.device("cuda")
    loader = DataLoader(ShardDataset(args.shards), batch_size=args.batch_size, shuffle=True,
                        num_workers=4, pin_memory=True, drop_last=True)
    model = BertForPretraining().to(device)
    no_decay = ("bias", "ln", "LayerNorm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, max(0.0, (args.max_steps - s) / (args.max_steps - args.warmup))))
    amp_autocast = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    scaler = make_grad_scaler()
    os.makedirs(args.out, exist_ok=True)

    step, micro = 0, 0
    model.train()
    while step < args.max_steps:
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            sel = labels != -100
            with amp_autocast():
                hidden = model(**batch)
                h = model.transform(hidden[sel])
                mlm_logits = F.linear(h, model.word_embeddings.weight, model.mlm_bias)
                loss = F.cross_entropy(mlm_logits, labels[sel])
                logit_mean = mlm_logits.mean()  # expect: AMP004
            scaler.scale(loss / args.accum_steps).backward()
            micro += 1
            if micro % args.accum_steps != 0:
                continue

            torch.nn.utils.clip_grad_value_(model.parameters(), args.clip_value)  # expect: AMP005
            scaler.unscale_(optimizer)
            grad_norm = torch.norm(torch.stack([p.grad.detach().float().norm() for p in model.parameters()
                                                if p.grad is not None]))
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} logit_mean {logit_mean.item():.3f} "
                      f"gnorm {grad_norm.item():.3f} scale {scaler.get_scale():.0f}")
            if step % 20000 == 0:
                torch.save({"model": model.state_dict(), "step": step}, os.path.join(args.out, f"step{step}.pt"))
            if step >= args.max_steps:
                break


if __name__ == "__main__":
    main()
