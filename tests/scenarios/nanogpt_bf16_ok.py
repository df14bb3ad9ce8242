"""EXPECT: none

HEALTHY: a nanoGPT-style training script in bf16 on the CPU, with the idioms a runtime
guard must accept: `dtype = "bfloat16"` looked up in the float32/bfloat16/float16 table,
`ctx = torch.amp.autocast(device_type=..., dtype=ptdtype)`, `scaler = torch.amp.GradScaler(
device_type, enabled=(dtype == "float16"))` (disabled in bf16) called unconditionally
(`scale`, `unscale_`, `step`, `update`), gradient accumulation over 4 micro-steps with
`loss = loss / gradient_accumulation_steps` inside the autocast block and the next batch
fetched between forward and backward, `clip_grad_norm_` after `unscale_`, AdamW with
decay/no-decay groups, warm-up + cosine learning rate, `estimate_loss()` under
`@torch.no_grad()` with `model.eval()`/`model.train()`, a causal mask filled with
`float("-inf")`. The token embedding has a vocabulary of 8192 and is not tied to the
output head: an optimizer step sees 2048 tokens (~1070 distinct), so ~87 % of the rows of
`transformer.wte.weight` get exactly-zero gradients at every step: sparsity, not underflow
(and bf16 has fp32's range). Unguarded: loss 9.02 -> 7.15 in 41 steps, val loss 7.37 at
step 40, raw norm 0.6-1.2 (clip 1.0), scale 1 (disabled scaler), nothing non-finite, the
smallest per-parameter max |grad| is 1.7e-4, no low-precision reduction.
"""
import json
import math
import time

import torch
import torch.nn as nn
from torch.nn import functional as F

import amp_runtime

# -----------------------------------------------------------------------------
# config, nanoGPT-style
eval_interval = 20
log_interval = 5
eval_iters = 2
gradient_accumulation_steps = 4
batch_size = 8
block_size = 64
vocab_size = 8192        # a BPE-sized vocabulary; a step sees ~1.2k distinct tokens
n_layer, n_head, n_embd = 2, 4, 64
dropout = 0.0
learning_rate = 2e-3
max_iters = 40
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 10
lr_decay_iters = 40
min_lr = 2e-4
device_type = "cpu"
dtype = "bfloat16"       # 'float32', 'bfloat16', or 'float16'
# -----------------------------------------------------------------------------
torch.manual_seed(1337)
torch.set_num_threads(1)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)


# poor man's data loader: a token stream with Zipfian unigrams and a learnable bigram rule
def make_stream(n, seed):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float)
    unigram = (1.0 / ranks) / (1.0 / ranks).sum()
    fresh = torch.multinomial(unigram, n, replacement=True, generator=g)
    follow = torch.rand(n, generator=g) < 0.6
    data = fresh.clone()
    for i in range(1, n):
        if follow[i]:
            data[i] = (data[i - 1] * 31 + 7) % vocab_size
    return data


train_data = make_stream(60_000, seed=1)
val_data = make_stream(6_000, seed=2)
batch_gen = torch.Generator().manual_seed(3)


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=batch_gen)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        # untied output head (as in LLaMA-style models): wte only gets the rows of the tokens in the batch
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


model = GPT()
# initialize a GradScaler. If enabled=False scaler is a no-op
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))

with amp_runtime.guard(policy="record", model=model) as g:
    X, Y = get_batch("train")
    t0 = time.time()
    iter_num = 0
    while True:
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0 and iter_num > 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
            # immediately async prefetch next batch while model is doing the forward pass on the GPU
            X, Y = get_batch("train")
            # backward pass, with gradient scaling if training in fp16
            scaler.scale(loss).backward()
        # clip the gradient
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        # step the optimizer and scaler if training in fp16
        scaler.step(optimizer)
        scaler.update()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % log_interval == 0:
            lossf = loss.item() * gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, grad norm {norm.item():.3g}, lr {lr:.2e}, "
                  f"scale {scaler.get_scale():g}, time {dt * 1000:.0f}ms")
        iter_num += 1
        if iter_num > max_iters:
            break

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
