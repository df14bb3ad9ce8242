"""BERT-style masked-language-model pretraining with bf16 autocast chosen by a flag."""
import argparse
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~pad_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = self.drop(scores.softmax(dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = SelfAttention(dim, heads)
        self.ln1 = nn.LayerNorm(dim, eps=1e-12)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln2 = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x, pad_mask):
        x = self.ln1(x + self.attn(x, pad_mask))
        return self.ln2(x + self.ff(x))


class BertForMLM(nn.Module):
    def __init__(self, vocab=30522, dim=768, layers=12, heads=12, max_len=512):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.emb_ln = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList([EncoderLayer(dim, heads) for _ in range(layers)])
        self.transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim, eps=1e-12))
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.tok.weight

    def forward(self, input_ids, pad_mask):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.emb_ln(self.tok(input_ids) + self.pos(pos))
        for layer in self.layers:
            h = layer(h, pad_mask)
        return self.decoder(self.transform(h)), h


def mask_tokens(input_ids, special_mask, mask_id, vocab, p=0.15):
    labels = input_ids.clone()
    probs = torch.full(labels.shape, p, device=labels.device).masked_fill(special_mask, 0.0)
    masked = torch.bernoulli(probs).bool()
    labels[~masked] = -100
    replace = torch.bernoulli(torch.full(labels.shape, 0.8, device=labels.device)).bool() & masked
    input_ids = input_ids.masked_fill(replace, mask_id)
    rand = torch.bernoulli(torch.full(labels.shape, 0.5, device=labels.device)).bool() & masked & ~replace
    input_ids[rand] = torch.randint(vocab, labels.shape, device=labels.device)[rand]
    return input_ids, labels


def build_model(args, device):
    model = BertForMLM(layers=args.layers)
    if args.pure_bf16_weights:
        model = model.to(device, dtype=torch.bfloat16)  # expect: AMP001
    else:
        model = model.to(device)
    return model


def train(args):
    device = torch.device("cuda")
    model = build_model(args, device)
    no_decay = ("bias", "ln", "LayerNorm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if args.amp else nullcontext()
    model.train()
    for step, batch in enumerate(args.loader):
        ids = batch["input_ids"].to(device, non_blocking=True)
        pad_mask = batch["attention_mask"].to(device).bool()
        ids, labels = mask_tokens(ids, batch["special_tokens_mask"].to(device).bool(), args.mask_id, args.vocab)
        with ctx:
            logits, hidden = model(ids, pad_mask)
            mlm = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
            seq_repr = hidden.float().mean(dim=1)
            logit_pen = logits.abs().mean()  # expect: AMP004
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            entropy = -(probs * probs.clamp_min(1e-6).log()).sum(-1).mean()
            loss = mlm + args.pen_weight * logit_pen
        (loss / args.accum).backward()
        if (step + 1) % args.accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(step, mlm.item(), entropy.item(), seq_repr.norm(dim=-1).mean().item())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    losses = []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = model(batch["input_ids"].to(device), batch["attention_mask"].to(device).bool())
            losses.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].to(device).flatten()).float())
    model.train()
    return torch.stack(losses).mean().exp().item()


def export_half(model, path):
    model = model.eval().half()
    torch.save(model.state_dict(), path)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--pure-bf16-weights", action="store_true")
    train(p.parse_args())
