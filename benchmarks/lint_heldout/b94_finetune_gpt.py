"""Fine-tune a pretrained GPT-2 checkpoint on a tokenized corpus.

<data_dir>/train.bin and val.bin hold uint16 token ids written by prepare.py, e.g.
    python finetune_gpt.py --data-dir data/shakespeare --init-from gpt2-medium --max-iters 2000
"""
import argparse
import copy
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        mask = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, -1e9)  # expect: AMP007
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @classmethod
    def from_pretrained(cls, model_type, dropout=0.0):
        from transformers import GPT2LMHeadModel
        shapes = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768),
                  "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024)}[model_type]
        model = cls(GPTConfig(**shapes, dropout=dropout))
        sd = model.state_dict()
        transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        for k, v in GPT2LMHeadModel.from_pretrained(model_type).state_dict().items():
            if k.endswith(".attn.masked_bias") or k.endswith(".attn.bias"):
                continue
            with torch.no_grad():
                sd[k].copy_(v.t() if k.endswith(transposed) else v)
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def get_batch(data_dir, split, block_size, batch_size, device):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    xy = torch.stack([torch.from_numpy(data[i:i + 1 + block_size].astype(np.int64)) for i in ix])
    xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


def overfit_one_batch(model, X, Y, steps=100, lr=3e-4):
    """Sanity check: a healthy setup drives the loss on one batch close to zero."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for i in range(steps):
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            _, loss = model(X, Y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % 10 == 0:
            print(f"overfit step {i}: loss {loss.item():.4f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out-dir", default="out-finetune")
    p.add_argument("--init-from", default="gpt2", choices=["gpt2", "gpt2-medium"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--grad-accum", type=int, default=16)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dtype", default="float16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--eval-interval", type=int, default=200)
    p.add_argument("--eval-iters", type=int, default=50)
    p.add_argument("--sanity-check", action="store_true")
    args = p.parse_args()

    device = device_type = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1337)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    model = GPT.from_pretrained(args.init_from, dropout=args.dropout)
    if args.block_size < model.config.block_size:
        model.config.block_size = args.block_size
        model.transformer.wpe.weight = nn.Parameter(model.transformer.wpe.weight[: args.block_size])
        for block in model.transformer.h:
            block.attn.bias = block.attn.bias[:, :, : args.block_size, : args.block_size]
    model.to(device)

    if args.sanity_check:
        X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, device)
        overfit_one_batch(model, X, Y)
        return

    scaler = torch.cuda.amp.GradScaler(enabled=(args.dtype == "float16"))  # expect: AMP009
    optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95), device_type)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(args.data_dir, split, args.block_size, args.batch_size, device)
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / (args.warmup_iters + 1)
        ratio = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
        min_lr = args.lr / 10
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - min_lr)

    os.makedirs(args.out_dir, exist_ok=True)
    best_val_loss = 1e9
    X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, device)
    t0 = time.time()
    for it in range(args.max_iters + 1):
        lr = get_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter": it,
                            "best_val_loss": best_val_loss, "args": vars(args)},
                           os.path.join(args.out_dir, "ckpt.pt"))

        for _ in range(args.grad_accum):
            with ctx:
                _, loss = model(X, Y)
                loss = loss / args.grad_accum
            X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, device)
            scaler.scale(loss).backward()
        if args.grad_clip > 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
        else:
            optimizer.step()  # expect: AMP006
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        if it % 10 == 0:
            print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f}, lr {lr:.2e}, {(time.time() - t0) * 100:.0f}ms/iter")
            t0 = time.time()


if __name__ == "__main__":
    main()
