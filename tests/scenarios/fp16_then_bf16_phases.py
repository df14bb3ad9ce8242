"""EXPECT: none
MAY: none
FAULT: none (healthy control). One run, one guard, one model (a small 1-D conv sequence
tagger) and one AdamW optimizer, trained in two phases by a nanoGPT-style `run_phase()`
that builds `scaler = torch.amp.GradScaler("cpu", enabled=(dtype == torch.float16))`
and always calls scale / unscale_ / clip / step / update:
  phase "fp16" (steps 0-19): fp16 autocast, the scaler enabled (it manages the steps);
  phase "bf16" (steps 20-39): bf16 autocast, a NEW scaler that is disabled (nanoGPT's
  idiom) and called anyway.
Per the docs, a disabled scaler scales nothing and the checks that need loss scaling stay
quiet: no AMP010 (the scaler in bf16 is disabled; fp16 has an active scaler), no
AMP107/AMP108 from the disabled scaler's scale of 1.0, no AMP006 (update follows every
step). Losses run on `.float()` logits, the enabled scaler never skips a step, gradient
norms stay < 3.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, TAGS, T = 64, 6, 48


class ConvTagger(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.conv1 = nn.Conv1d(d, d, kernel_size=5, padding=2)
        self.conv2 = nn.Conv1d(d, d, kernel_size=5, padding=2)
        self.out = nn.Linear(d, TAGS)

    def forward(self, tokens):
        h = self.embed(tokens).transpose(1, 2)          # (B, d, T)
        h = F.relu(self.conv1(h))
        h = F.relu(self.conv2(h))
        return self.out(h.transpose(1, 2))             # (B, T, TAGS)


def batch_stream(batch_size=32, seed=7):
    g = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, VOCAB, (batch_size, T), generator=g)
        prev = torch.roll(tokens, 1, dims=1)
        tags = (tokens + prev) % TAGS                  # tag depends on a 2-token window
        yield tokens, tags


def run_phase(model, optimizer, batches, dtype, steps, log):
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == torch.float16))
    for _ in range(steps):
        tokens, tags = next(batches)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(tokens)
            loss = F.cross_entropy(logits.float().reshape(-1, TAGS), tags.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        log.append((str(dtype), loss.item(), scaler.get_scale()))


def main():
    model = ConvTagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = batch_stream()
    log = []
    with amp_runtime.guard(policy="record", model=model) as g:
        run_phase(model, optimizer, batches, torch.float16, 20, log)
        run_phase(model, optimizer, batches, torch.bfloat16, 20, log)
    assert log[-1][1] < log[0][1], log
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
