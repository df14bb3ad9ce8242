"""
Decoder-only LM with our own attention module: plain causal, prefix-LM and retrieval
cross-attention variants, plus the pre-training loop and the SFT step.

Mixed precision: torch.amp.autocast + GradScaler for float16, autocast alone for bfloat16.
(Checkpoints from before the switch were trained under torch.cuda.amp.autocast and load fine.)
"""
import argparse
import inspect
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
class LMConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    attention: str = "causal"  # "causal" | "prefix"
    retrieval_every: int = 0  # add cross-attention to neighbours every N blocks (0: off)
    sliding_window: int = 0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * norm).to(x.dtype) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.window = config.sliding_window
        self.flash = hasattr(F, "scaled_dot_product_attention")
        bs = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(bs, bs)).view(1, 1, bs, bs), persistent=False)

    def _attend(self, q, k, v, pad_mask, prefix_len):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, -1e9)  # expect: AMP007
        if self.window:
            far = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-self.window)
            att = att.masked_fill(far, -1e9 if att.dtype == torch.float32 else -1e4)
        if pad_mask is not None:
            att = att.masked_fill(~pad_mask[:, None, None, :], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return att @ v

    def forward(self, x, pad_mask=None, prefix_len=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash and pad_mask is None and prefix_len is None and not self.window:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            y = self._attend(q, k, v, pad_mask, prefix_len)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class PrefixLMAttention(CausalSelfAttention):
    """Bidirectional over the first ``prefix_len`` tokens of each row, causal after them."""

    def _attend(self, q, k, v, pad_mask, prefix_len):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        bias = torch.full((T, T), -1e9, dtype=q.dtype, device=q.device).triu_(1)  # expect: AMP007
        if prefix_len is not None:
            in_prefix = torch.arange(T, device=q.device)[None, :] < prefix_len[:, None]
            bias = bias[None].masked_fill(in_prefix[:, None, :], 0.0)[:, None]
        att = att + bias
        if pad_mask is not None:
            att = att.masked_fill(~pad_mask[:, None, None, :], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return att @ v


class RetrievalCrossAttention(nn.Module):
    """Cross-attention from the sequence to embeddings of retrieved neighbour chunks."""

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.kv_proj = nn.Linear(config.n_embd, 2 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, mem, mem_mask):
        B, T, C = x.shape
        M = mem.size(1)
        hs = C // self.n_head
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)
        k, v = self.kv_proj(mem).split(C, dim=2)
        k = k.view(B, M, self.n_head, hs).transpose(1, 2)
        v = v.view(B, M, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = torch.where(mem_mask[:, None, None, :], att, torch.tensor(-1e9, device=att.device))  # expect: AMP007
        att = self.dropout(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


ATTENTION_CLASSES = {"causal": CausalSelfAttention, "prefix": PrefixLMAttention}


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd)
        self.attn = ATTENTION_CLASSES[config.attention](config)
        self.ln_2 = RMSNorm(config.n_embd)
        self.mlp = MLP(config)
        use_xattn = config.retrieval_every and (layer_idx + 1) % config.retrieval_every == 0
        self.xattn = RetrievalCrossAttention(config) if use_xattn else None
        self.ln_x = RMSNorm(config.n_embd) if use_xattn else None

    def forward(self, x, pad_mask=None, prefix_len=None, mem=None, mem_mask=None):
        x = x + self.attn(self.ln_1(x), pad_mask=pad_mask, prefix_len=prefix_len)
        if self.xattn is not None and mem is not None:
            x = x + self.xattn(self.ln_x(x), mem, mem_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=RMSNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, pad_mask=None, prefix_len=None, mem=None, mem_mask=None, all_logits=False):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of length {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, pad_mask=pad_mask, prefix_len=prefix_len, mem=mem, mem_mask=mem_mask)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x if all_logits else x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=use_fused)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# ----------------------------------------------------------------------------- training


def get_batch(data_dir, split, block_size, batch_size, device):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model, ctx, args):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(args.data_dir, split, args.block_size, args.batch_size, args.device)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


@torch.no_grad()
def eval_perplexity(model, ctx, batches):
    nll, count = 0.0, 0
    for X, Y in batches:
        with ctx:
            logits, _ = model(X, all_logits=True)
        logits = logits.float()
        nll += F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), ignore_index=-1, reduction="sum").item()
        count += (Y != -1).sum().item()
    return math.exp(nll / max(count, 1))


def sft_step(model, batch, optimizer, scaler, grad_clip):
    input_ids, labels, attn_mask, prefix_len = (t.to("cuda", non_blocking=True) for t in batch)
    with torch.autocast("cuda", dtype=torch.float16):
        logits, _ = model(input_ids, pad_mask=attn_mask, prefix_len=prefix_len, all_logits=True)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1)  # expect: AMP002
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def benchmark(model, optimizer, batch_size, block_size, vocab_size, steps=20):
    X = torch.randint(vocab_size, (batch_size, block_size), device="cuda")
    Y = torch.randint(vocab_size, (batch_size, block_size), device="cuda")
    scaler = torch.amp.GradScaler("cuda")
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.float16):
            _, loss = model(X, Y)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.time() - t0) / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="data/openwebtext")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--grad-accum", type=int, default=40)
    p.add_argument("--max-iters", type=int, default=600000)
    p.add_argument("--eval-interval", type=int, default=2000)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--attention", default="causal")
    p.add_argument("--benchmark", action="store_true")
    args = p.parse_args()

    device_type = "cuda" if "cuda" in args.device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    config = LMConfig(block_size=args.block_size, attention=args.attention)
    model = GPT(config).to(args.device)
    optimizer = model.configure_optimizers(0.1, args.lr, (0.9, 0.95), device_type)
    if args.benchmark:
        print(f"{benchmark(model, optimizer, args.batch_size, args.block_size, config.vocab_size) * 1e3:.1f} ms/iter")
        return
    scaler = torch.amp.GradScaler("cuda", enabled=(args.dtype == "float16"))

    best_val_loss = 1e9
    X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, args.device)
    for it in range(args.max_iters):
        if it % args.eval_interval == 0:
            losses = estimate_loss(model, ctx, args)
            print(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter": it},
                           os.path.join(args.out_dir, "ckpt.pt"))
        for micro_step in range(args.grad_accum):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / args.grad_accum
            X, Y = get_batch(args.data_dir, "train", args.block_size, args.batch_size, args.device)
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
