"""EXPECT: none
MAY: none
FAULT: none -- a healthy control in nanoGPT's style: a 2-layer character GPT (tied embeddings,
hand-written causal attention with nanoGPT's `masked_fill(self.bias[:, :, :T, :T] == 0,
float('-inf'))`, the loss computed inside `forward`, `logits, loss = model(X, Y)`) trains in
CPU autocast bfloat16 through a module-level `ctx = torch.amp.autocast(device_type=...,
dtype=ptdtype)`, with `scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))`
(disabled in bf16) called unconditionally (`scaler.scale(loss).backward()`,
`scaler.unscale_`, `clip_grad_norm_(..., 1.0)`, `scaler.step`, `scaler.update`), a cosine
learning-rate schedule, the next batch fetched between forward and backward, and an
`estimate_loss()` under `@torch.inference_mode()` with `model.eval()` / `model.train()` every
10 iterations and at the end (the evaluation also runs under `ctx`).  Checked with plain torch
below: every loss finite, gradient norms between 0.05 and 10, every row of the causal mask has
an unmasked key (no all -inf row).
Why nothing (quotes from docs): REAL_WORLD_IDIOMS "`GradScaler(enabled=False)`,
`GradScaler(enabled=dtype == "float16")`", "Every scaler method must work on a disabled
scaler", "bf16 autocast with no scaler (correct)", "Safe mask values: ... `float("-inf")`",
"Eval and sampling inside the training script: `estimate_loss()` ... every N iterations, then
back to `model.train()`"; AMP010 "`GradScaler(enabled=False)` and `GradScaler(enabled=dtype ==
torch.float16)` are fine"; index.md "A disabled scaler scales nothing: the checks that need
loss scaling stay quiet"; AMP004 leaves "code under `torch.inference_mode()`" alone.
Anything reported here is a false alarm (or a guard failure, AMP100).
"""
import json
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

# ----------------------------------------------------------------------------- config
device_type = "cpu"
dtype = "bfloat16"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
block_size, batch_size, n_layer, n_head, n_embd = 32, 8, 2, 2, 32
max_iters, eval_interval, eval_iters = 30, 10, 4
learning_rate, min_lr, warmup_iters, grad_clip = 3e-3, 3e-4, 5, 1.0

# ----------------------------------------------------------------------------- data
words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "red", "box", "and", "hid"]
g = torch.Generator().manual_seed(1)
text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (3000,), generator=g))
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]
vocab_size = len(chars)


def make_batches(split, count, seed):
    src = train_data if split == "train" else val_data
    gen = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(src) - block_size - 1, (count, batch_size), generator=gen)
    xs = torch.stack([torch.stack([src[i:i + block_size] for i in row]) for row in ix])
    ys = torch.stack([torch.stack([src[i + 1:i + 1 + block_size] for i in row]) for row in ix])
    return xs, ys


TRAIN_X, TRAIN_Y = make_batches("train", max_iters + 1, 2)
EVAL = {split: make_batches(split, eval_iters, 3 + k) for k, split in enumerate(["train", "val"])}


# ----------------------------------------------------------------------------- model
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
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


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
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build():
    torch.manual_seed(0)
    return GPT()


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.inference_mode()
def estimate_loss(model):
    out = {}
    model.eval()
    for split, (xs, ys) in EVAL.items():
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            with ctx:
                _, loss = model(xs[k], ys[k])
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def train(model, log=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
    history = []
    X, Y = TRAIN_X[0], TRAIN_Y[0]
    for iter_num in range(max_iters):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(iter_num)
        if iter_num % eval_interval == 0:
            ev = estimate_loss(model)
            history += [ev["train"], ev["val"]]
        with ctx:
            logits, loss = model(X, Y)
        X, Y = TRAIN_X[iter_num + 1], TRAIN_Y[iter_num + 1]
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        history.append(loss.detach().clone())
        if log is not None:
            log.append((iter_num, loss.item(), float(norm)))
    ev = estimate_loss(model)
    history += [ev["train"], ev["val"]]
    return history, {k: v.detach().clone() for k, v in model.state_dict().items()}


def precheck():
    log = []
    hist, _ = train(build(), log)
    for it, loss, norm in log[::5] + log[-1:]:
        print(f"PRECHECK iter {it:2d} loss {loss:.4f} grad norm {norm:.3g}")
    print("PRECHECK evals (train, val):", [round(float(h), 4) for h in hist[:2]], "...", [round(float(h), 4) for h in hist[-2:]])
    mask = torch.tril(torch.ones(block_size, block_size))
    assert bool((mask.sum(-1) > 0).all())
    assert all(math.isfinite(float(h)) for h in hist)
    assert all(0.05 < norm < 10 for _, _, norm in log)
    with ctx:
        logits, _ = build()(TRAIN_X[0], TRAIN_Y[0])
    print("PRECHECK logits dtype under ctx:", logits.dtype)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    precheck()
    ref_hist, ref_weights = train(build())
    model = build()
    with amp_runtime.guard(policy="record") as gd:
        hist, weights = train(model)
    print("LOSSES_MATCH", len(hist) == len(ref_hist) and all(same(a, b) for a, b in zip(hist, ref_hist)))
    print("WEIGHTS_MATCH", weights.keys() == ref_weights.keys() and all(same(weights[k], ref_weights[k]) for k in weights))
    for e in gd.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} :: {e.message}")
    print("COUNTS", json.dumps(gd.report.to_json().get("counts", {}), sort_keys=True))
    print("EVENTS", json.dumps(sorted(set(gd.report.codes()))))


if __name__ == "__main__":
    main()
