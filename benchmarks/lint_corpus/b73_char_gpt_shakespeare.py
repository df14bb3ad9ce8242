# %% [markdown]
# # Char-level GPT on tiny-shakespeare, with a sliding-window attention variant
# Research scratchpad: compares full causal attention against a local window of
# `window` tokens at equal compute. Based on nanoGPT's model.py / train.py, flattened.
# The last cell fine-tunes HF gpt2 on the same text for reference.

# %%
import copy
import math
import os
import pickle
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

CFG = dict(
    out_dir="out-shakespeare-char",
    dataset="data/shakespeare_char",
    attn="local",  # "full" | "local"
    window=64,
    block_size=256,
    batch_size=64,
    n_layer=6,
    n_head=6,
    n_embd=384,
    dropout=0.2,
    learning_rate=1e-3,
    max_iters=5000,
    lr_decay_iters=5000,
    min_lr=1e-4,
    warmup_iters=100,
    gradient_accumulation_steps=1,
    grad_clip=1.0,
    eval_interval=250,
    eval_iters=200,
    weight_decay=1e-1,
    beta2=0.99,
    compile=False,
)

device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if "cuda" in device else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True
os.makedirs(CFG["out_dir"], exist_ok=True)

# %% data
train_data = np.memmap(os.path.join(CFG["dataset"], "train.bin"), dtype=np.uint16, mode="r")
val_data = np.memmap(os.path.join(CFG["dataset"], "val.bin"), dtype=np.uint16, mode="r")
with open(os.path.join(CFG["dataset"], "meta.pkl"), "rb") as f:
    meta = pickle.load(f)
vocab_size, stoi, itos = meta["vocab_size"], meta["stoi"], meta["itos"]


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - CFG["block_size"], (CFG["batch_size"],))
    x = torch.stack([torch.from_numpy(data[i:i + CFG["block_size"]].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + CFG["block_size"]].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# %% model
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def scores(self, q, k, T):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        return att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = F.softmax(self.scores(q, k, T), dim=-1)
        y = self.attn_dropout(att) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class LocalSelfAttention(CausalSelfAttention):
    """Causal attention restricted to the last `window` positions."""

    def __init__(self, n_embd, n_head, block_size, dropout, window):
        super().__init__(n_embd, n_head, block_size, dropout)
        idx = torch.arange(block_size)
        local = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < window)
        self.register_buffer("local", local.view(1, 1, block_size, block_size), persistent=False)

    def scores(self, q, k, T):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        return att.masked_fill(~self.local[:, :, :T, :T], -1e10)  # expect: AMP007


class Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        n_embd = attn.n_embd
        self.ln_1 = RMSNorm(n_embd)
        self.attn = attn
        self.ln_2 = RMSNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False), nn.Dropout(CFG["dropout"]))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


ATTENTION = {
    "full": lambda c: CausalSelfAttention(c["n_embd"], c["n_head"], c["block_size"], c["dropout"]),
    "local": lambda c: LocalSelfAttention(c["n_embd"], c["n_head"], c["block_size"], c["dropout"], c["window"]),
}


class GPT(nn.Module):
    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.block_size = cfg["block_size"]
        self.wte = nn.Embedding(vocab_size, cfg["n_embd"])
        self.wpe = nn.Embedding(cfg["block_size"], cfg["n_embd"])
        self.drop = nn.Dropout(cfg["dropout"])
        self.h = nn.ModuleList([Block(ATTENTION[cfg["attn"]](cfg)) for _ in range(cfg["n_layer"])])
        self.ln_f = RMSNorm(cfg["n_embd"])
        self.lm_head = nn.Linear(cfg["n_embd"], vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.block_size else idx[:, -self.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits.float(), dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


# %% optimizer / helpers
model = GPT(CFG, vocab_size).to(device)
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": CFG["weight_decay"]},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=CFG["learning_rate"], betas=(0.9, CFG["beta2"]), fused=device_type == "cuda")
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
if CFG["compile"]:
    model = torch.compile(model)


def get_lr(it):
    if it < CFG["warmup_iters"]:
        return CFG["learning_rate"] * (it + 1) / (CFG["warmup_iters"] + 1)
    if it > CFG["lr_decay_iters"]:
        return CFG["min_lr"]
    ratio = (it - CFG["warmup_iters"]) / (CFG["lr_decay_iters"] - CFG["warmup_iters"])
    return CFG["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (CFG["learning_rate"] - CFG["min_lr"])


def optimizer_step(model, optimizer, scaler, grad_clip):
    grad_norm = None
    if grad_clip != 0.0:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(CFG["eval_iters"])
        for k in range(CFG["eval_iters"]):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


# %% train
best_val_loss = 1e9
X, Y = get_batch("train")
t0 = time.time()
for iter_num in range(CFG["max_iters"] + 1):
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % CFG["eval_interval"] == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "cfg": CFG,
                        "iter_num": iter_num, "best_val_loss": best_val_loss},
                       os.path.join(CFG["out_dir"], f"ckpt_{CFG['attn']}.pt"))

    for micro_step in range(CFG["gradient_accumulation_steps"]):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / CFG["gradient_accumulation_steps"]
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    grad_norm = optimizer_step(model, optimizer, scaler, CFG["grad_clip"])

    if iter_num % 50 == 0:
        dt, t0 = time.time() - t0, time.time()
        lossf = loss.item() * CFG["gradient_accumulation_steps"]
        print(f"iter {iter_num}: loss {lossf:.4f}, |g| {grad_norm:.3f}, time {dt * 1000 / 50:.1f}ms/it")

# %% sample from the fp16 copy
model.eval()
with torch.no_grad():
    sample_model = copy.deepcopy(model).half()
    start = torch.tensor([[stoi["\n"]]], dtype=torch.long, device=device)
    out = sample_model.generate(start, max_new_tokens=500, temperature=0.8, top_k=200)
print("".join(itos[i] for i in out[0].tolist()))


# %% reference: fine-tune HF gpt2 (byte-level BPE) on the same text
def finetune_gpt2(text_path, steps=500, seq_len=256, bs=8):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    tok = GPT2TokenizerFast.from_pretrained("gpt2")
    ids = torch.tensor(tok(open(text_path).read())["input_ids"], dtype=torch.long)
    hf_model = GPT2LMHeadModel.from_pretrained("gpt2", torch_dtype=torch.float16).to(device)  # expect: AMP001
    hf_model.train()
    opt = torch.optim.AdamW(hf_model.parameters(), lr=5e-5, weight_decay=0.0)  # expect: AMP011
    for step in range(steps):
        ix = torch.randint(len(ids) - seq_len - 1, (bs,))
        xb = torch.stack([ids[i:i + seq_len] for i in ix]).to(device)
        out = hf_model(input_ids=xb, labels=xb)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"[gpt2] step {step}: loss {out.loss.item():.4f}")
    return hf_model


finetune_gpt2("data/shakespeare_char/input.txt")
