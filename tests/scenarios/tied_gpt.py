"""EXPECT: none

FAULT: none (healthy control). A nanoGPT-style character/BPE language model with tied
input/output embeddings (`wte.weight = lm_head.weight`) over a large vocabulary (6144)
fed Zipf-distributed tokens, so most embedding rows are absent from any batch (their
input-side gradient is exactly zero; sparsity, not underflow). fp16 CPU autocast through
a module-level `ctx`, `GradScaler(enabled=(dtype == "float16"))`, a linear-warmup +
cosine-decay learning rate set by hand in every param group, weight decay only on 2-D
parameters, and the loss computed *outside* the autocast region from upcast logits
(`F.cross_entropy(logits.float().view(-1, V), y.view(-1))`), which is the fp32 loss
idiom, not a low-precision loss. Clip after unscale_, no skipped steps, gradient norm
in a normal range. 40 optimizer steps.
"""
import json
import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(1337)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
device_type = "cpu"
dtype = "float16"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

vocab_size, block_size, n_layer, n_head, n_embd = 6144, 32, 2, 4, 64
batch_size = 8
learning_rate, min_lr, warmup_iters, lr_decay_iters, max_iters = 3e-3, 3e-4, 10, 40, 40
weight_decay, grad_clip = 0.1, 1.0


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (z.view(B, T, n_head, C // n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight          # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


# Zipfian "corpus" with local structure: token t is often followed by (t * 31 + 7) % V
_g = torch.Generator().manual_seed(0)
_ranks = torch.arange(1, vocab_size + 1, dtype=torch.float)
_probs = (1.0 / _ranks) / (1.0 / _ranks).sum()
_corpus = torch.multinomial(_probs, 20000, replacement=True, generator=_g)
_follow = torch.rand(20000, generator=_g) < 0.5
_corpus[1:][_follow[1:]] = (_corpus[:-1][_follow[1:]] * 31 + 7) % vocab_size


def get_batch():
    ix = torch.randint(len(_corpus) - block_size - 1, (batch_size,), generator=_g)
    x = torch.stack([_corpus[i:i + block_size] for i in ix])
    y = torch.stack([_corpus[i + 1:i + 1 + block_size] for i in ix])
    return x, y


def train():
    model = GPT()
    optimizer = model.configure_optimizers()
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    X, Y = get_batch()
    for iter_num in range(max_iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        with ctx:
            logits = model(X)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), Y.view(-1))
        X, Y = get_batch()
        scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if DEBUG:
            print(f"iter {iter_num}: loss {loss.item():.4f}, lr {lr:.2e}, norm {norm.item():.3f}, "
                  f"scale {scaler.get_scale()}", file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
