"""EXPECT: none

HEALTHY: a small byte-level causal transformer LM (2 pre-norm
``nn.TransformerEncoderLayer``s, d=64, 4 heads) trained with bf16 CPU autocast on
long sequences (T=512), with no GradScaler (correct for bf16), AdamW,
``clip_grad_norm_(1.0)`` and a cosine schedule. The causal mask is a float -inf mask
made once in ``__init__`` (before the guard, fp32, the ``float("-inf")`` idiom),
the loss (cross_entropy, fp32 on CPU autocast) is computed inside the region,
``backward()`` outside it. The residual stream stays fp32 (fp32 embeddings plus bf16
block outputs promote to fp32); the script writes no sum/mean/var of its own
(clip_grad_norm_ runs on the fp32 gradients).

Pages: AMP010 flags a scaler with bf16 and fp16 without one - neither here ("bf16
autocast with no scaler (correct)"); AMP006/AMP005 do not apply without a scaler;
AMP007 only for constants beyond 65504 meeting fp16; AMP106 is about fp16 flushing
("train in bf16, whose range reaches 1.2e-38 and needs no scaling"); gradient norms
are ~1 (clipped), no layer's gradients vanish (the fused in_proj bias of
MultiheadAttention gets gradients through q and v). Nothing should be reported.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, DIM, HEADS, LAYERS, T, BATCH = 256, 64, 4, 2, 512, 4


class ByteLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(T, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=4 * DIM, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(T), persistent=False)

    def forward(self, idx):
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = self.blocks(x, mask=self.causal[:t, :t], is_causal=True)
        return self.lm_head(self.norm(x))


# a synthetic "text": a repeating pattern with noise, so the LM has something to learn
corpus = torch.randint(32, 127, (64,)).repeat(400)
noise = torch.rand(corpus.shape) < 0.05
corpus[noise] = torch.randint(32, 127, (int(noise.sum()),))


def get_batch():
    starts = torch.randint(0, corpus.numel() - T - 1, (BATCH,))
    x = torch.stack([corpus[s:s + T] for s in starts])
    y = torch.stack([corpus[s + 1:s + T + 1] for s in starts])
    return x, y


STEPS = 12
model = ByteLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, STEPS) / STEPS)))

with amp_runtime.guard(policy="record") as g:
    for step in range(STEPS):
        x, y = get_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step:2d} loss {loss.item():.4f} grad-norm {norm.item():.3f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
