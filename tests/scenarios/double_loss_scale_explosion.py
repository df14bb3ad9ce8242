"""EXPECT: AMP104
FAULT: double loss scaling in an fp16 intent classifier. The script started from an
apex O2 recipe with a static loss scale of 1024; when it moved to
`torch.amp.GradScaler` the constant stayed: `scaler.scale(loss * STATIC_LOSS_SCALE)`.
GradScaler only divides its own scale back out, so the gradients the optimizer
applies are 1024x the true ones. AdamW's per-parameter normalisation hides this (the
loss still falls), and there is no clipping. Measured without the guard: the
gradients after GradScaler's unscaling have a total norm of 102 at step 0, 86-125
over steps 0-60 and then growing to 550 by step 116, never above 1000, so AMP104 (P1)
must be reported. The scaler (`init_scale=2**12`) skips only steps 0, 2 and 32 while it
settles to 512 (two skips before the first step that goes through, one decrease
after): never 5 consecutive decreases, never below 1/100 of its initial value (41),
never below 128, and no skip once a 100-step window is full, so AMP108/AMP109 are not
expected; all values stay finite (no AMP103/AMP112) and no layer's gradients come
near zero.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB = 5000
N_INTENTS = 24
EMBED_DIM = 64
BATCH = 128
SEQ = 24
STEPS = 120
STATIC_LOSS_SCALE = 1024.0  # kept from the apex O2 recipe this script started from


class IntentClassifier(nn.Module):
    """fastText-style bag of embeddings followed by an MLP."""

    def __init__(self):
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, EMBED_DIM, mode="mean")
        self.mlp = nn.Sequential(
            nn.Linear(EMBED_DIM, 256), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(256, 256), nn.GELU(),
        )
        self.classifier = nn.Linear(256, N_INTENTS)

    def forward(self, tokens):
        return self.classifier(self.mlp(self.embed(tokens)))


def utterances(seed=0):
    """Each intent prefers its own slice of the vocabulary; the rest is filler."""
    gen = torch.Generator().manual_seed(seed)
    slice_len = VOCAB // (2 * N_INTENTS)
    while True:
        intent = torch.randint(0, N_INTENTS, (BATCH,), generator=gen)
        filler = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        keyword = intent.unsqueeze(1) * slice_len + torch.randint(0, slice_len, (BATCH, SEQ), generator=gen)
        use_kw = torch.rand(BATCH, SEQ, generator=gen) < 0.3
        yield torch.where(use_kw, keyword, filler), intent


model = IntentClassifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
data = utterances()

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        tokens, intent = next(data)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
            loss = F.cross_entropy(logits.float(), intent)
        # BUG: the static loss scale of the old recipe is applied on top of GradScaler
        # and never divided out again
        scaler.scale(loss * STATIC_LOSS_SCALE).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == STEPS - 1:
            acc = (logits.argmax(dim=1) == intent).float().mean().item()
            print(f"step {step:4d}  loss {loss.item():.4f}  acc {acc:.3f}  scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
