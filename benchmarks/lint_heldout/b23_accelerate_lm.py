"""Fine-tune a small causal LM on pre-tokenised text.

Uses accelerate when it is installed (multi-GPU, mixed precision handled by it);
otherwise falls back to a hand-written single-GPU loop with its own fp16 handling.

    accelerate launch b23_accelerate_lm.py --data tokens.pt --mixed-precision fp16
    python b23_accelerate_lm.py --data tokens.pt --mixed-precision fp16 --no-accelerate
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

try:
    from accelerate import Accelerator
except ImportError:
    Accelerator = None


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads, block_size, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        causal = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.causal[:, :, :T, :T] == 0, -1e9)  # expect: AMP007
        if pad_mask is not None:
            att = att.masked_fill(~pad_mask[:, None, None, :], torch.finfo(att.dtype).min)
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, dim, heads, block_size):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block_size)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, pad_mask=None):
        x = x + self.attn(self.ln1(x), pad_mask)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim=512, depth=8, heads=8, block_size=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, block_size) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx, pad_mask=None):
        T = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x, pad_mask)
        return self.lm_head(self.ln_f(x))


class TokenDataset(Dataset):
    def __init__(self, path, block_size):
        data = torch.load(path)
        self.ids = data["input_ids"][:, :block_size]
        self.mask = data["attention_mask"][:, :block_size]

    def __len__(self):
        return self.ids.size(0)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


def lm_loss(logits, input_ids, attention_mask):
    labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def train_accelerate(args, train_ds):
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.accum)
    model = TinyLM(args.vocab, block_size=args.block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for epoch in range(args.epochs):
        for step, batch in enumerate(loader):
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    logits = model(batch["input_ids"], batch["attention_mask"].bool())
                    loss = lm_loss(logits, batch["input_ids"], batch["attention_mask"])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.is_main_process and step % args.log_every == 0:
                accelerator.print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
    accelerator.wait_for_everyone()
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out, "tinylm.pt"))


def train_fallback(args, train_ds):
    """Plain PyTorch loop for machines without accelerate."""
    device = torch.device("cuda")
    use_fp16 = args.mixed_precision == "fp16"
    model = TinyLM(args.vocab, block_size=args.block_size).to(device)
    if use_fp16:
        model.half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)  # expect: AMP011
    try:
        scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler(enabled=use_fp16)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=4)
    model.train()
    for epoch in range(args.epochs):
        for step, batch in enumerate(loader):
            ids = batch["input_ids"].to(device, non_blocking=True)
            mask = batch["attention_mask"].to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=use_fp16):  # expect: AMP009
                logits = model(ids, mask.bool())
                loss = lm_loss(logits, ids, mask)
                log_z = torch.logsumexp(logits, dim=-1)
                z_loss = args.z_loss * (log_z * log_z).mean()  # expect: AMP004
                loss = (loss + z_loss) / args.accum
            scaler.scale(loss).backward()
            if (step + 1) % args.accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            if step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss.item() * args.accum:.4f}")
    torch.save(model.state_dict(), os.path.join(args.out, "tinylm.pt"))


@torch.no_grad()
def perplexity(model, loader, device):
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        ids = batch["input_ids"].to(device)
        mask = batch["attention_mask"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(ids, mask.bool())
        total += lm_loss(logits.float(), ids, mask).item() * ids.size(0)
        count += ids.size(0)
    return math.exp(total / max(count, 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="out")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--z-loss", type=float, default=1e-4)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="fp16")
    p.add_argument("--no-accelerate", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    train_ds = TokenDataset(args.data, args.block_size)
    if Accelerator is not None and not args.no_accelerate:
        train_accelerate(args, train_ds)
    else:
        train_fallback(args, train_ds)


if __name__ == "__main__":
    main()
