"""Small GPT pretraining in the style of nanoGPT (ctx = nullcontext or torch.amp.autocast)."""
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
    block_size: int = 256
    vocab_size: int = 50304
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.1
    bias: bool = False
    window: int = 0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.window = config.window
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))[None, None])
        self.rel_bias = nn.Parameter(torch.zeros(1, config.n_head, config.block_size, config.block_size))

    def forward(self, x, pad_mask=None):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att + self.rel_bias[:, :, :T, :T].to(att.dtype)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        if self.window > 0:
            pos = torch.arange(T, device=x.device)
            far = (pos[None, :] - pos[:, None]).abs() > self.window
            att = att.masked_fill(far, -1e8 if att.dtype == torch.float32 else -1e4)
        if pad_mask is not None:
            att = att.masked_fill(pad_mask[:, None, None, :] == 0, -1e9)  # expect: AMP007
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias), nn.Dropout(config.dropout))

    def forward(self, x, pad_mask=None):
        x = x + self.attn(self.ln_1(x), pad_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config, allowed_tokens=None):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.allowed_tokens = allowed_tokens

    def forward(self, idx, targets=None, pad_mask=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x, pad_mask)
        x = self.ln_f(x)
        logits = self.lm_head(x if targets is not None else x[:, [-1], :])
        if self.allowed_tokens is not None:
            logits = torch.where(self.allowed_tokens, logits, torch.tensor(-1e9, device=logits.device))  # expect: AMP007
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        groups = [{"params": [p for p in self.parameters() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in self.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


def get_batch(data, block_size, batch_size, device):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model, splits, ctx, eval_iters, block_size, batch_size, device):
    out = {}
    model.eval()
    for split, data in splits.items():
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            with ctx:
                _, loss = model(*get_batch(data, block_size, batch_size, device))
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def export_half_checkpoint(model, path):
    """Write float16 weights for the serving image (half the download)."""
    serving = copy.deepcopy(model).half().eval()
    torch.save({"model": serving.state_dict(), "config": model.config}, path)


def generate_text(model, prompt_ids, steps=200, device="cuda"):
    model = model.half().to(device).eval()
    with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
        return model.generate(prompt_ids.to(device), steps, temperature=0.8, top_k=200)


def train(dtype="bfloat16", device="cuda", data_dir="data/owt", out_dir="out", max_iters=5000, grad_accum=4,
          grad_clip=1.0, batch_size=12, block_size=256):
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    splits = {s: np.memmap(os.path.join(data_dir, f"{s}.bin"), dtype=np.uint16, mode="r") for s in ("train", "val")}
    model = GPT(GPTConfig(block_size=block_size)).to(device)
    scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    best_val_loss = 1e9
    X, Y = get_batch(splits["train"], block_size, batch_size, device)
    for it in range(max_iters):
        if it % 250 == 0:
            losses = estimate_loss(model, splits, ctx, 200, block_size, batch_size, device)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "iter_num": it}, os.path.join(out_dir, "ckpt.pt"))
                export_half_checkpoint(model, os.path.join(out_dir, "serve_fp16.pt"))
        for micro_step in range(grad_accum):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / grad_accum
            X, Y = get_batch(splits["train"], block_size, batch_size, device)
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model, ctx, scaler, optimizer


def train_sft(model, batches, optimizer, scaler, ctx):
    model.train()
    for X, Y in batches:
        with ctx:
            _, loss = model(X, Y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)


def finetune_lowmem(model, data, device="cuda", iters=1000, lr=3e-5, block_size=256):
    """Continue training on a domain corpus with half the activation memory."""
    model = model.to(device, dtype=torch.bfloat16)  # expect: AMP001
    optimizer = model.configure_optimizers(0.0, lr, (0.9, 0.95))
    for it in range(iters):
        X, Y = get_batch(data, block_size, 8, device)
        _, loss = model(X, Y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def bench(model, X, Y, optimizer, dtype, n=20):
    t0 = time.time()
    for _ in range(n):
        with torch.autocast("cuda", dtype=dtype):
            _, loss = model(X, Y)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.time() - t0) / n


if __name__ == "__main__":
    gpt, amp_ctx, grad_scaler, opt = train(dtype=os.environ.get("DTYPE", "bfloat16"))
    sft_data = [get_batch(np.zeros(4096, dtype=np.uint16), 256, 8, "cuda") for _ in range(10)]
    train_sft(gpt, sft_data, opt, grad_scaler, amp_ctx)
    print(generate_text(copy.deepcopy(gpt), torch.zeros((1, 1), dtype=torch.long)))
