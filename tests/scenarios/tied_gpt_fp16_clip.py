"""EXPECT: none
FAULT: none (healthy control). A nanoGPT-style fp16 language model whose output head
is tied to its 4096x64 token embedding (`wte.weight = lm_head.weight`), GPT-2
initialisation (std 0.02, scaled c_proj), Zipf-distributed synthetic tokens, AdamW
with warm-up + cosine decay, `torch.amp.GradScaler("cpu")` at its default scale 65536,
and the documented order `scaler.scale(loss).backward(); scaler.unscale_(opt);
clip_grad_norm_(..., 1.0); scaler.step(opt); scaler.update()`, with `estimate_loss()`
under `torch.no_grad()`/`model.eval()` inside the loop. It looks dangerous: the tied
matrix receives both the sparse lookup gradient and the dense softmax gradient over a
long-tailed vocabulary (the AMP106 page's own example of rare-token gradients), the
gradients are scaled by 65536, and the same Parameter appears as embedding and head.
Measured without the guard: no skipped step, the scale stays 65536, the raw (unscaled)
norm returned by `clip_grad_norm_` is 1.3-2.3 and the applied one 1.0, every layer's
largest gradient is above 4e-5, and no scaled weight gradient sits at fp16's smallest
subnormal (0 values in the 2^-24 bin, no flushed values). Loss falls from 8.3 to ~6.0
in 80 iterations. Per the pages no code applies: AMP104 judges the unscaled, clipped
norm (1.0), AMP105/AMP106 have nothing to report, the scaler never backs off.
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB = 4096
BLOCK = 32
N_LAYER = 2
N_HEAD = 4
N_EMBD = 64
BATCH = 16
MAX_ITERS = 80
WARMUP_ITERS = 10
LEARNING_RATE = 6e-4
MIN_LR = 6e-5
GRAD_CLIP = 1.0
EVAL_INTERVAL = 20
EVAL_ITERS = 2


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
        return logits, loss


class ZipfBigramCorpus:
    """A synthetic 'language': Zipf-distributed unigrams, each token has a few likely successors."""

    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        ranks = torch.arange(1, VOCAB + 1, dtype=torch.float32)
        self.unigram = ranks.pow(-1.1)
        self.unigram /= self.unigram.sum()
        self.successors = torch.multinomial(self.unigram.expand(VOCAB, -1), 4, replacement=True, generator=self.gen)

    def batch(self):
        seq = torch.empty(BATCH, BLOCK + 1, dtype=torch.long)
        seq[:, 0] = torch.multinomial(self.unigram, BATCH, replacement=True, generator=self.gen)
        for t in range(1, BLOCK + 1):
            follow = self.successors[seq[:, t - 1], torch.randint(0, 4, (BATCH,), generator=self.gen)]
            fresh = torch.multinomial(self.unigram, BATCH, replacement=True, generator=self.gen)
            keep = torch.rand(BATCH, generator=self.gen) < 0.7
            seq[:, t] = torch.where(keep, follow, fresh)
        return seq[:, :-1], seq[:, 1:]


def get_lr(it):
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / WARMUP_ITERS
    ratio = (it - WARMUP_ITERS) / (MAX_ITERS - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


train_data, val_data = ZipfBigramCorpus(seed=0), ZipfBigramCorpus(seed=0)
val_data.gen.manual_seed(1234)
model = GPT()
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
    lr=LEARNING_RATE, betas=(0.9, 0.95),
)
scaler = torch.amp.GradScaler("cpu")
ctx = torch.autocast("cpu", dtype=torch.float16)


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = []
    for _ in range(EVAL_ITERS):
        x, y = val_data.batch()
        with ctx:
            _, loss = model(x, y)
        losses.append(loss.item())
    model.train()
    return sum(losses) / len(losses)


with amp_runtime.guard(policy="record", model=model) as g:
    for it in range(MAX_ITERS):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        if it % EVAL_INTERVAL == 0:
            print(f"iter {it:4d}  val loss {estimate_loss():.4f}")
        x, y = train_data.batch()
        with ctx:
            logits, loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if it % 10 == 0 or it == MAX_ITERS - 1:
            print(f"iter {it:4d}  loss {loss.item():.4f}  grad norm {grad_norm.item():.3f}  scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
