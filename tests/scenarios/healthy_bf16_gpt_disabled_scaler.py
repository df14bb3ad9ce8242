"""EXPECT: none
FAULT: none (healthy control). nanoGPT-style causal transformer LM (2 layers, d=64, tied
embedding/head, vocab 2048) in bf16 autocast on the CPU with nanoGPT's idiom
`GradScaler(enabled=(dtype == "float16"))`, i.e. a DISABLED scaler that is still called
(`scaler.scale(loss).backward()`, `scaler.unscale_`, `scaler.step`, `scaler.update`): per the
docs a disabled scaler scales nothing, the loss-scale checks stay quiet and bf16 without a
working scaler is fine (no AMP010). Also: AdamW with decay/no-decay param groups, warmup +
cosine LambdaLR, `clip_grad_norm_` after `unscale_`, right-padded documents whose padded targets
are ignore_index=-100 and whose padded keys are masked together with the causal mask via
`masked_fill(~mask, torch.finfo(att.dtype).min)` (finite in bf16, no row fully masked: each
query sees at least itself), an evaluation under `torch.no_grad()` every 10 steps. About 2% of
the nonzero gradients of `h.1.attn.c_attn.weight` at steps 0-1 would flush in an fp16 backward at
scale 1 (AMP106's estimate), which is harmless in bf16: AMP106 is about fp16 loss scaling, and
with a disabled scaler "the checks that need loss scaling stay quiet". All reductions (loss,
norms) run in fp32; no NaN/inf, grad norm 0.45-1.0.
"""
import json
import math

import torch
from torch import nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, BLOCK, DIM, HEADS, LAYERS, BATCH = 2048, 32, 64, 4, 2, 12
dtype = "bfloat16"


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.register_buffer("causal", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)))

    def forward(self, x, key_valid):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = self.causal[:t, :t][None, None] & key_valid[:, None, None, :]
        mask = mask | torch.eye(t, dtype=torch.bool)[None, None]      # every query sees itself
        att = att.masked_fill(~mask, torch.finfo(att.dtype).min)
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, key_valid):
        x = x + self.attn(self.ln_1(x), key_valid)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(BLOCK, DIM)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight                          # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, key_valid, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x, key_valid)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-100)
        return logits, loss


def get_batch(seed):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (start + torch.arange(BLOCK + 1) * 3 + torch.randint(0, 2, (BATCH, BLOCK + 1), generator=g)) % VOCAB
    lengths = torch.randint(BLOCK // 2, BLOCK + 1, (BATCH,), generator=g)
    valid = torch.arange(BLOCK)[None, :] < lengths[:, None]
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
    x[~valid] = 0
    y[~valid] = -100
    return x, y, valid


model = GPT()
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
MAX_ITERS, WARMUP = 40, 5
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda it: (it + 1) / WARMUP if it < WARMUP
    else 0.1 + 0.45 * (1 + math.cos(math.pi * (it - WARMUP) / (MAX_ITERS - WARMUP))))
scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
ctx = torch.autocast("cpu", dtype=torch.bfloat16)
eval_losses = []

with amp_runtime.guard(policy="record", model=model) as g:
    for it in range(MAX_ITERS):
        if it % 10 == 0:
            model.eval()
            with torch.no_grad():
                xb, yb, vb = get_batch(99_999)
                with ctx:
                    _, vloss = model(xb, vb, yb)
                eval_losses.append(vloss.item())
            model.train()
        xb, yb, vb = get_batch(it)
        with ctx:
            _, loss = model(xb, vb, yb)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
