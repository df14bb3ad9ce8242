"""EXPECT: none

HEALTHY: the twin of f4: the same byte-level transformer LM in fp16 autocast, two
optimizers (embeddings/head, blocks) with one GradScaler at its default 65536, and
per-parameter-group clip_grad_norm_ after scaler.unscale_ of both; the loss is the plain
per-token mean cross-entropy. Checked without the guard: loss finite at all 70 steps
(AMP112, AMP101), gradients finite (AMP103), the scaler never skips and stays at 65536
(AMP107, AMP108, AMP109); total gradient norm 0.075-0.21 and every clip group's raw norm
<= 0.21 (AMP104); every parameter's largest gradient >= 1.8e-4 (AMP105); an fp32
recomputation of the gradients at steps 0/32/64 finds 0% of any weight's nonzero
gradients below 2**-25/65536, and the smallest-subnormal-bin estimate is 0 (AMP106).
Residual adds promote to fp32 and no reduction runs in fp16 (AMP110, AMP111); no cast,
epsilon or backward under autocast (code-pattern rules).
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
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        idx, targets = markov_batch(trans, gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
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
