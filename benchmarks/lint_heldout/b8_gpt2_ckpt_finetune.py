"""
Fine-tune GPT-2 (124M..1.5B) on prompt/completion pairs with a hand-written loop.
Gradient checkpointing per block, loss on completion tokens only, nanoGPT-style config.

$ python finetune_gpt2.py --init_from gpt2-xl --data_dir data/alpaca --dtype float16 --grad_ckpt
"""
import argparse
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    grad_ckpt: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, attention_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = att.new_full((T, T), -1e9).triu(1)  # expect: AMP007
        att = att + causal
        if attention_mask is not None:
            att = att.masked_fill(attention_mask[:, None, None, :] == 0, torch.finfo(att.dtype).min)
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
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

    def forward(self, x, attention_mask=None):
        x = x + self.attn(self.ln_1(x), attention_mask)
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

    def forward(self, idx, attention_mask=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.config.grad_ckpt and self.training:
                x = checkpoint(block, x, attention_mask, use_reentrant=False)
            else:
                x = block(x, attention_mask)
        return self.lm_head(self.transformer.ln_f(x))

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        from transformers import GPT2LMHeadModel
        config_args = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768), "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
                       "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280), "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600)}[model_type]
        config_args.update(override_args or {})
        model = GPT(GPTConfig(**config_args))
        sd = model.state_dict()
        sd_hf = GPT2LMHeadModel.from_pretrained(model_type).state_dict()
        transposed = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]
        with torch.no_grad():
            for k, v in sd_hf.items():
                if k.endswith(".attn.masked_bias") or k.endswith(".attn.bias"):
                    continue
                sd[k].copy_(v.t() if any(k.endswith(w) for w in transposed) else v)
        return model

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits = self(idx_cond)[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


def completion_loss(logits, targets, loss_mask):
    """Next-token cross-entropy on completion tokens only (prompt tokens have loss_mask == 0)."""
    ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none").view_as(loss_mask)
    return (ce * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.learning_rate * it / args.warmup_iters
    if it > args.lr_decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr)


def export_fp16(ckpt_path, out_path):
    ckpt = torch.load(ckpt_path, map_location="cpu")
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.half().eval()
    torch.save(model.state_dict(), out_path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--init_from", default="gpt2-medium")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="out-ft")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--gradient_accumulation_steps", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=3e-5)
    p.add_argument("--min_lr", type=float, default=3e-6)
    p.add_argument("--warmup_iters", type=int, default=100)
    p.add_argument("--lr_decay_iters", type=int, default=2000)
    p.add_argument("--max_iters", type=int, default=2000)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--eval_interval", type=int, default=200)
    p.add_argument("--eval_iters", type=int, default=40)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--grad_ckpt", action="store_true")
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    device_type = "cuda" if "cuda" in args.device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    def get_batch(split):
        data = np.memmap(os.path.join(args.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        mask = np.memmap(os.path.join(args.data_dir, f"{split}_mask.bin"), dtype=np.uint8, mode="r")
        ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
        m = torch.stack([torch.from_numpy(mask[i + 1:i + 1 + args.block_size].astype(np.float32)) for i in ix])
        if device_type == "cuda":
            return [t.pin_memory().to(args.device, non_blocking=True) for t in (x, y, m)]
        return [t.to(args.device) for t in (x, y, m)]

    model = GPT.from_pretrained(args.init_from, dict(dropout=args.dropout, grad_ckpt=args.grad_ckpt))
    model.to(args.device)
    if args.dtype == "float16":
        # gpt2-xl + optimizer state does not fit a 16 GB V100 in fp32
        model = model.half()  # expect: AMP001
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95))  # expect: AMP011
    scaler = torch.amp.GradScaler("cuda", enabled=(args.dtype == "float16"))
    raw_model = model
    if args.compile:
        model = torch.compile(model)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y, M = get_batch(split)
                with ctx:
                    logits = model(X)
                    losses[k] = completion_loss(logits, Y, M).item()
            out[split] = losses.mean()
        model.train()
        return out

    X, Y, M = get_batch("train")
    iter_num, best_val_loss, t0 = 0, 1e9, time.time()
    while iter_num <= args.max_iters:
        lr = get_lr(iter_num, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                            "best_val_loss": best_val_loss, "model_args": vars(raw_model.config)},
                           os.path.join(args.out_dir, "ckpt.pt"))
        for micro_step in range(args.gradient_accumulation_steps):
            with ctx:
                logits = model(X)
            loss = completion_loss(logits, Y, M) / args.gradient_accumulation_steps  # expect: AMP002
            X, Y, M = get_batch("train")
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if iter_num % 10 == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {iter_num}: loss {loss.item() * args.gradient_accumulation_steps:.4f}, lr {lr:.2e}, {dt * 1000:.0f}ms")
        iter_num += 1
    export_fp16(os.path.join(args.out_dir, "ckpt.pt"), os.path.join(args.out_dir, "model_fp16.pt"))


if __name__ == "__main__":
    main()
