"""EXPECT: AMP101 AMP107 AMP108 AMP109 AMP112
MAY: AMP102 AMP105 AMP106

FAULT: a pointer-network head divides its fp16 attention scores by an annealed
temperature (wav2vec2-style schedule `max(max_temp * decay**updates, min_temp)`, set
through `set_num_updates` every step) whose floor `min_temp` is 1e-7 instead of 0.5, so the
inverse temperature keeps growing (x10 every ~22 updates). From step ~40 the scaled
backward through `scores / temperature` overflows on some steps (GradScaler skips them,
the scale falls: AMP108; more than 1% of the 100-step window skipped and rising once the
window is full at step ~100: AMP109). From step 119 the forward itself overflows:
`scores / self.temperature` (div in `head`) turns finite fp16 scores into inf, the
cross-entropy is NaN at backward (AMP112), and since the temperature keeps falling every
later batch overflows too: the scale halves every step, below 1 by step ~125 and never
rising (AMP107). The replay of the first NaN step names the div (AMP101). The loop
unscales before clipping (correct); the raw gradient norm exceeds 1000 before the
overflow but the applied, clipped norm is 1 (no AMP104).
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

D_IN, D_ATTN, SLOTS, BATCH, STEPS, WARMUP = 32, 32, 16, 32, 160, 10
BASE_LR = 3e-3
# temperature annealing (as in wav2vec2's Gumbel quantizer): max_temp, min_temp, decay
TEMP_SCHEDULE = (2.0, 1e-7, 0.9)


class PointerHead(nn.Module):
    """Points at the memory slot whose key matches the query."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D_IN, D_ATTN)
        self.k_proj = nn.Linear(D_IN, D_ATTN)
        self.max_temp, self.min_temp, self.temp_decay = TEMP_SCHEDULE
        self.temperature = self.max_temp

    def set_num_updates(self, num_updates):
        self.temperature = max(self.max_temp * self.temp_decay ** num_updates, self.min_temp)

    def forward(self, query, memory):
        q = self.q_proj(query).unsqueeze(1)                 # (B, 1, D)
        k = self.k_proj(memory)                             # (B, T, D)
        scores = (q @ k.transpose(1, 2)).squeeze(1) / math.sqrt(D_ATTN)
        return scores / self.temperature


class Retriever(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D_IN, D_IN), nn.GELU(), nn.Linear(D_IN, D_IN))
        self.head = PointerHead()

    def forward(self, query, memory):
        return self.head(self.encoder(query), self.encoder(memory))


def batches(generator):
    while True:
        memory = torch.randn(BATCH, SLOTS, D_IN, generator=generator)
        target = torch.randint(0, SLOTS, (BATCH,), generator=generator)
        query = memory[torch.arange(BATCH), target] + 0.3 * torch.randn(BATCH, D_IN, generator=generator)
        yield query, memory, target


def lr_lambda(step):
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 1.0


model = Retriever()
optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
scaler = torch.amp.GradScaler("cpu")
data = batches(torch.Generator().manual_seed(1))

skipped = 0
with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        query, memory, target = next(data)
        model.head.set_num_updates(step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(query, memory)
            loss = F.cross_entropy(logits.float(), target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        raw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if scaler.get_scale() < scale:
            skipped += 1
        if step % 10 == 0 or step == STEPS - 1:
            peak = logits.detach().float().abs().max().item()
            print(f"step {step:3d} loss {loss.item():.4f} raw_grad_norm {raw_norm.item():.3e} "
                  f"scale {scale:.3g} skipped {skipped} temp {model.head.temperature:.2e} "
                  f"max|logit| {peak:.1f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
