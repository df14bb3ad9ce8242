"""GPT pretraining in the nanoGPT single-file style (config globals, top-level loop), with sliding-window attention."""
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
out_dir = "out"
eval_interval = 2000
eval_iters = 200
always_save_checkpoint = True
dataset = "openwebtext"
gradient_accumulation_steps = 40
batch_size = 12
block_size = 1024
vocab_size = 50304
n_layer, n_head, n_embd = 12, 12, 768
dropout = 0.0
bias = False
window = 256
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
device = "cuda"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
compile = True
benchmark = False
# -----------------------------------------------------------------------------


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        # sliding-window causal bias: 0 inside the window, a large negative number elsewhere
        band = att.new_full((T, T), -1e9).triu(1) + att.new_full((T, T), -1e9).tril(-window)  # expect: AMP007
        att = F.softmax(att + band, dim=-1)
        y = self.attn_dropout(att) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias)
        self.attn = CausalSelfAttention()
        self.ln_2 = LayerNorm(n_embd, bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = LayerNorm(n_embd, bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
data_dir = os.path.join("data", dataset)


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def get_sft_batch():
    x, y = get_batch("sft")
    return x, y, (y != 0)


model = GPT()
model.to(device)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # expect: AMP009
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
raw_model = model
if compile:
    model = torch.compile(model)


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


def masked_sft_loss(X, Y, loss_mask):
    """Instruction-tuning mix: only answer tokens contribute to the loss."""
    with ctx:
        logits, _ = model(X)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), reduction="none")  # expect: AMP002
    loss_mask = loss_mask.view(-1).float()
    return (loss * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def benchmark_mfu(num_steps=20):
    X, Y = get_batch("train")
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(num_steps):
        with ctx:
            _, loss = model(X, Y)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.time() - t0) / num_steps
    flops = 6 * sum(p.numel() for p in raw_model.parameters()) * batch_size * block_size
    print(f"{dt * 1000:.1f} ms/iter, {flops / dt / 312e12 * 100:.1f}% MFU")


if benchmark:
    benchmark_mfu()
    raise SystemExit

X, Y = get_batch("train")
t0 = time.time()
iter_num = 0
best_val_loss = 1e9
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                          "iter_num": iter_num, "best_val_loss": best_val_loss}
            torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if dataset == "sft_mix":
            Xs, Ys, M = get_sft_batch()
            loss = masked_sft_loss(Xs, Ys, M) / gradient_accumulation_steps
        else:
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)  # expect: AMP006
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % 10 == 0:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > max_iters:
        break
