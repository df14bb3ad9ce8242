"""EXPECT: AMP106

FAULT: a byte-level transformer LM in fp16 autocast with two optimizers (embeddings/head at
a higher learning rate, the blocks with decay/no-decay groups), one GradScaler, and
per-parameter-group clip_grad_norm_ after scaler.unscale_ of both. Two compounding
mistakes make its gradients flush in the fp16 backward: the loss is cross_entropy's mean
divided again by targets.numel() (2048 tokens: a leftover from a sum-reduced loss), so
every gradient is 2048x too small, and the scaler starts at init_scale=16 ("no skipped
first steps") and, growing only after 2000 good steps, stays at 16 for the 70 steps.
Scaled gradients below 2**-25 (unscaled 1.9e-9) become exact zeros. Checked against an
fp32 recomputation of the same gradients at the same weights: at steps 0/32/64,
4.8%/9.2%/17% of blocks.0.attn.qkv.weight's nonzero gradients and 5.0%/10.9%/21.7% of
blocks.1.attn.qkv.weight's fall under that limit (tok.weight 2.5%/5.3%/12.5%), carrying
0.3%-3.5% of those layers' gradient norm (the page's 0.1% floor); the page's own estimate
(half the count in fp16's smallest subnormal bin) gives 7.9%/13.8%/11.9% for
blocks.0.attn.qkv.weight, 8.7%/11.8%/14.0% for blocks.1.attn.qkv.weight.
- AMP106 (grad-underflow page): > 1% of a weight matrix's nonzero gradients flush at the
  current scale on every judged step (every 32nd), with a norm share above 0.1%.
Not expected: AMP105 (total norm 2.2e-5..1.7e-4, above 1e-6; every parameter's largest
gradient >= 1.1e-8, above 1e-10), AMP107 (scale 16 > 1), AMP108 (the scale never
decreases: 16 < 128 but not falling, and never below 16/100), AMP109/AMP103/AMP104/
AMP112/AMP101 (no overflow, no skipped step, finite loss and gradients, norms ~1e-4),
code-pattern rules (loss on .float() inside autocast, unscale_ before clipping, one
scaler.update per iteration).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, D_MODEL, HEADS, DEPTH, SEQ, BATCH, STEPS = 128, 64, 4, 2, 128, 16, 70


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def markov_batch(trans, gen):
    """Token streams from a fixed sparse Markov chain (a stand-in for a byte corpus)."""
    idx = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    idx[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    for t in range(SEQ):
        idx[:, t + 1] = torch.multinomial(trans[idx[:, t]], 1, generator=gen).squeeze(1)
    return idx[:, :-1], idx[:, 1:]


gen = torch.Generator().manual_seed(1)
trans = torch.rand(VOCAB, VOCAB, generator=gen).pow(8)
trans = trans / trans.sum(dim=1, keepdim=True)

model = TinyLM()
matrices = [p for n, p in model.blocks.named_parameters() if p.dim() == 2]
vectors = [p for n, p in model.blocks.named_parameters() if p.dim() < 2]
# two optimizers: embeddings/head at a higher learning rate, the blocks with decay groups;
# each parameter group is clipped on its own
embed_opt = torch.optim.AdamW([
    {"params": list(model.tok.parameters()) + list(model.pos.parameters()), "max_norm": 1.0},
    {"params": list(model.ln_f.parameters()) + list(model.head.parameters()), "max_norm": 1.0},
], lr=3e-3, weight_decay=0.0)
block_opt = torch.optim.AdamW([
    {"params": matrices, "weight_decay": 0.1, "max_norm": 0.5},
    {"params": vectors, "weight_decay": 0.0, "max_norm": 0.5},
], lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=16.0)  # small start: no skipped first steps

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        idx, targets = markov_batch(trans, gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / targets.numel()  # per-token loss
        scaler.scale(loss).backward()
        scaler.unscale_(embed_opt)
        scaler.unscale_(block_opt)
        for opt in (embed_opt, block_opt):
            for group in opt.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], group["max_norm"])
        scaler.step(embed_opt)
        scaler.step(block_opt)
        scaler.update()
        embed_opt.zero_grad(set_to_none=True)
        block_opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4g} scale {scaler.get_scale():g}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
