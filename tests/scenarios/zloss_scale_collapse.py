"""EXPECT: AMP107 AMP108
MAY: AMP106

FAULT: an fp16 text classifier (GradScaler, `unscale_` then `clip_grad_norm_`, warm-up +
cosine schedule) adds a PaLM-style z-loss on the log-partition function, but its
coefficient in the config is 1e8 instead of 1e-4. The loss itself stays finite in fp32
(about 5e8), yet the gradient reaching the fp16 logits through `logits.float()` is
~1e6 times the loss scale, so the fp16 backward overflows on every step while the scale
is large: GradScaler skips the first 26 steps in a row and halves the scale from 65536
to 2^-10 (below 1/100 of its initial value and below 128 while falling: AMP108; at or
below 1 from step ~16 on and, with `growth_interval=2000`, never rising again: AMP107).
The forward is finite throughout (no AMP101/AMP112); the skipped steps are caught by the
scaler (no AMP103); clipping runs on unscaled gradients and the applied norm is 1 (no
AMP104, although the raw norm is ~2e8). Once the scale is ~1e-3, the cross-entropy part
of the fp16 gradients is scaled down by 1000 and small gradients may flush (AMP106
possible). AMP109 cannot fire: its window starts at the first step not skipped (26) and
is not full by step 79.
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

CONFIG = {
    "vocab": 512, "dim": 64, "classes": 10, "seq_len": 24, "batch": 32,
    "steps": 80, "warmup": 8, "lr": 1e-3, "clip": 1.0, "z_loss": 1e8,
}


class BagOfTokensClassifier(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.EmbeddingBag(cfg["vocab"], cfg["dim"], mode="mean")
        self.mlp = nn.Sequential(nn.Linear(cfg["dim"], 4 * cfg["dim"]), nn.GELU(),
                                 nn.Linear(4 * cfg["dim"], cfg["dim"]), nn.GELU())
        self.head = nn.Linear(cfg["dim"], cfg["classes"])

    def forward(self, tokens):
        return self.head(self.mlp(self.embed(tokens)))


def batches(cfg, generator):
    prototypes = torch.randint(0, cfg["vocab"], (cfg["classes"], cfg["seq_len"]), generator=generator)
    while True:
        labels = torch.randint(0, cfg["classes"], (cfg["batch"],), generator=generator)
        tokens = prototypes[labels].clone()
        noise = torch.rand(tokens.shape, generator=generator) < 0.3
        tokens[noise] = torch.randint(0, cfg["vocab"], (int(noise.sum()),), generator=generator)
        yield tokens, labels


def warmup_cosine(cfg):
    def factor(step):
        if step < cfg["warmup"]:
            return (step + 1) / cfg["warmup"]
        progress = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


model = BagOfTokensClassifier(CONFIG)
optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"], weight_decay=0.05)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(CONFIG))
scaler = torch.amp.GradScaler("cpu")
data = batches(CONFIG, torch.Generator().manual_seed(5))

skipped = 0
with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(CONFIG["steps"]):
        tokens, labels = next(data)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens).float()
            ce = F.cross_entropy(logits, labels)
            z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
            loss = ce + CONFIG["z_loss"] * z_loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        raw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG["clip"])
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if scaler.get_scale() < scale:
            skipped += 1
        if step % 5 == 0 or step == CONFIG["steps"] - 1:
            print(f"step {step:3d} loss {loss.item():.4e} ce {ce.item():.4f} raw_grad_norm {raw_norm.item():.3e} "
                  f"scale {scale:.3g} skipped {skipped}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
