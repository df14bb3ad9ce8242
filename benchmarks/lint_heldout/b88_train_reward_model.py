"""Pairwise reward model on top of a pretrained GPT checkpoint.

Each example is a (prompt + chosen, prompt + rejected) pair; the reward is read from the
hidden state of the last non-pad token and trained with the Bradley-Terry objective.
"""
import argparse
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.register_buffer("bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size))
                             .view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x, attn_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = self.bias[:, :, :T, :T].bool()
        if attn_mask is not None:
            keep = causal & attn_mask[:, None, None, :].bool()
            att = torch.where(keep, att, torch.full_like(att, -1e9))  # expect: AMP007
        else:
            att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x, attn_mask=None):
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def forward_hidden(self, idx, attn_mask=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, attn_mask)
        return self.ln_f(x)


class PairDataset(Dataset):
    def __init__(self, path, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["chosen_ids"][-self.max_len:], r["rejected_ids"][-self.max_len:]


def collate_pairs(batch, pad_id=50256):
    seqs = [c for c, _ in batch] + [r for _, r in batch]
    T = max(len(s) for s in seqs)
    idx = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return idx, mask


def pairwise_loss(model, reward_head, idx, mask):
    h = model.forward_hidden(idx, mask)
    last = mask.sum(dim=1) - 1
    r = reward_head(h[torch.arange(h.size(0), device=h.device), last]).squeeze(-1).float()
    r_chosen, r_rejected = r.chunk(2)
    loss = -F.logsigmoid(r_chosen - r_rejected).mean()
    acc = (r_chosen > r_rejected).float().mean()
    return loss, acc


@torch.no_grad()
def evaluate(model, reward_head, loader, device):
    model.eval()
    losses, accs = [], []
    for idx, mask in loader:
        loss, acc = pairwise_loss(model, reward_head, idx.to(device), mask.to(device))
        losses.append(loss.item())
        accs.append(acc.item())
    model.train()
    return sum(losses) / len(losses), sum(accs) / len(accs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-from", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--head-lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--out-dir", default="out-rm")
    args = ap.parse_args()

    device = "cuda"
    ckpt = torch.load(args.init_from, map_location="cpu")
    cfg = GPTConfig(**ckpt["model_args"])
    model = GPT(cfg)
    model.load_state_dict({k: v for k, v in ckpt["model"].items() if not k.startswith("lm_head")}, strict=False)
    model = model.cuda().half()  # expect: AMP001
    reward_head = nn.Linear(cfg.n_embd, 1, bias=False).cuda().half()  # expect: AMP001
    nn.init.normal_(reward_head.weight, std=1.0 / math.sqrt(cfg.n_embd + 1))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, eps=1e-8)  # expect: AMP011
    head_optimizer = torch.optim.Adam(reward_head.parameters(), lr=args.head_lr, eps=1e-8)  # expect: AMP011

    train_loader = DataLoader(PairDataset(args.train, args.max_len), batch_size=args.batch_size,
                              shuffle=True, collate_fn=collate_pairs, drop_last=True)
    val_loader = DataLoader(PairDataset(args.val, args.max_len), batch_size=args.batch_size,
                            collate_fn=collate_pairs)

    best_val_loss = 1e9
    os.makedirs(args.out_dir, exist_ok=True)
    it = 0
    for epoch in range(args.epochs):
        for idx, mask in train_loader:
            idx, mask = idx.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            loss, acc = pairwise_loss(model, reward_head, idx, mask)
            optimizer.zero_grad(set_to_none=True)
            head_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            head_optimizer.step()
            it += 1
            if it % 50 == 0:
                print(f"iter {it}: loss {loss.item():.4f}, acc {acc.item():.3f}")
            if it % 500 == 0:
                val_loss, val_acc = evaluate(model, reward_head, val_loader, device)
                print(f"val loss {val_loss:.4f} acc {val_acc:.3f}")
                if val_loss < best_val_loss:
                    best_val_loss = val_loss
                    torch.save({"model": model.state_dict(), "head": reward_head.state_dict(),
                                "model_args": ckpt["model_args"]}, os.path.join(args.out_dir, "rm.pt"))


if __name__ == "__main__":
    main()
