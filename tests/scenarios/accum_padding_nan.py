"""EXPECT: AMP101 AMP108 AMP112

FAULT: TokenShiftLM.forward averages each micro-batch's loss over its own tokens,
`loss = (nll * mask).sum() / n_tokens`, with no guard for a micro-batch that holds padding
only. Each step takes a variable number of documents (12-40), length-buckets them and splits
them into 2-5 micro-batches of 8 rows (gradient accumulation over a variable count, loss
divided by that count). Blank lines of the corpus (4 %) sort to the end, and when the last
micro-batch is all blank lines its loss is 0/0 = NaN: in 8 of the 90 steps (1, 26, 31, 46, 50,
56, 65, 84). fp16 autocast with a GradScaler, clipping after unscale_.
- AMP112: backward starts from that NaN micro-batch loss (scaled, still NaN).
- AMP101: the division in TokenShiftLM.forward (inside the model, a root module) turns two
  finite zeros into NaN; on the CPU the step is judged before anything is applied and the
  GradScaler skips it, so the replay runs and names that op (one forward call of 2-5).
- AMP108: every NaN step is skipped and halves the scale: 65536 -> 512 at the 7th (step 65),
  below 1/100 of the initial scale; 256 at the end.
Must stay silent: AMP107 (the scale never goes below 256), AMP109 (90 steps, the 100-step
window is never full), AMP103 (the scaler catches every NaN), AMP104 (norms clipped to 1).
"""
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, PAD, SEQ, DIM = 96, 0, 33, 64
BLANK_RATE = 0.04         # blank lines in the corpus
MICRO_ROWS = 8            # rows per micro-batch; the number of micro-batches varies per step
STEPS, WARMUP, BASE_LR = 90, 10, 2e-3
LOG_EVERY = 10


class TokenShiftLM(nn.Module):
    """Embedding -> causal token-shift mixing -> MLP head; returns its own loss dict."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.mix = nn.Linear(3 * DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, 2 * DIM)
        self.head = nn.Linear(2 * DIM, VOCAB)

    def forward(self, tokens, targets):
        e = self.embed(tokens)                                            # (B, T, D)
        prev1 = F.pad(e, (0, 0, 1, 0))[:, :-1]                            # token t-1
        prev2 = F.pad(e, (0, 0, 2, 0))[:, :-2]                            # token t-2
        h = F.gelu(self.mix(torch.cat([e, prev1, prev2], dim=-1)))
        logits = self.head(F.gelu(self.proj(h))).float()                  # fp32 for the loss
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
        mask = (targets.reshape(-1) != PAD).float()
        n_tokens = mask.sum()
        # token-mean over the real (non-pad) targets of this micro-batch
        loss = (nll * mask).sum() / n_tokens
        return {"loss": loss, "n_tokens": n_tokens}


class DocStream:
    """Documents from a sparse Markov chain; a few lines of the corpus are blank."""

    def __init__(self, seed=1):
        self.trans = torch.randint(1, VOCAB, (VOCAB, 3), generator=torch.Generator().manual_seed(1234))
        self.g = torch.Generator().manual_seed(seed)

    def step_batch(self):
        """A variable number of documents per step, length-bucketed into micro-batches."""
        g = self.g
        n_docs = int(torch.randint(12, 41, (1,), generator=g))
        lengths = torch.randint(6, SEQ + 1, (n_docs,), generator=g)
        lengths[torch.rand(n_docs, generator=g) < BLANK_RATE] = 0     # blank lines
        toks = torch.empty(n_docs, SEQ, dtype=torch.long)
        toks[:, 0] = torch.randint(1, VOCAB, (n_docs,), generator=g)
        choice = torch.randint(0, 3, (n_docs, SEQ), generator=g)
        for t in range(1, SEQ):
            toks[:, t] = self.trans[toks[:, t - 1], choice[:, t]]
        toks[torch.arange(SEQ)[None, :] >= lengths[:, None]] = PAD
        order = torch.argsort(lengths, descending=True, stable=True)   # length bucketing
        toks = toks[order]
        return [(mb[:, :-1], mb[:, 1:]) for mb in toks.split(MICRO_ROWS)]


def lr_at(step):
    if step < WARMUP:
        return BASE_LR * (step + 1) / WARMUP
    t = (step - WARMUP) / (STEPS - WARMUP)
    return BASE_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def main():
    model = TokenShiftLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    stream = DocStream()
    t0 = time.time()
    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            micro_batches = stream.step_batch()
            n_micro = len(micro_batches)
            step_loss, step_tokens = 0.0, 0
            for tokens, targets in micro_batches:
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(tokens, targets)
                    loss = out["loss"] / n_micro
                scaler.scale(loss).backward()
                step_loss += loss.item()
                step_tokens += int(out["n_tokens"])
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step % LOG_EVERY == 0 or not math.isfinite(step_loss):
                print(f"step {step:3d} loss {step_loss:.4f} micro {n_micro} tokens {step_tokens:4d} "
                      f"grad_norm {float(grad_norm):.3f} scale {scaler.get_scale():.0f} "
                      f"lr {lr_at(step):.2e}")
    print(f"done in {time.time() - t0:.1f}s, final scale {scaler.get_scale():.0f}")
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
