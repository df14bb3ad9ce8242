"""EXPECT: none

HEALTHY: the look-alike of s19_accum_padding_nan.py, written correctly. Same model, stream
and variable accumulation (2-5 micro-batches a step, fp16 autocast, GradScaler, unscale_
then clip), but: the loss of a micro-batch is `nll_sum / step_tokens` (normalised by the
tokens of the whole step, as Hugging Face's num_items_in_batch does); a micro-batch of blank
lines is skipped with `continue` before its forward (8 of them); at a shard boundary (steps
28, 57, 86) the stream yields nothing and the loop `continue`s before any backward or
optimizer step, so there are 87 optimizer steps in 90 iterations; the model also clamps its
own token count (min 1). Every 15 steps it evaluates under torch.inference_mode() and fp16
autocast, model.eval() then model.train(). Unguarded: no skipped step, scale 65536
throughout, clipped norms 0.18-1.0, no NaN, fp16 peaks below 25, no low-precision reduction.
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
EVAL_EVERY = 15
SHARD_STEPS = 29         # the stream reopens a shard every 29 steps and yields nothing once


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
        nll_sum = (nll * mask).sum()
        # token-mean of this micro-batch, safe for a micro-batch of padding only
        return {"loss": nll_sum / n_tokens.clamp(min=1.0), "nll_sum": nll_sum, "n_tokens": n_tokens}


class DocStream:
    """Documents from a sparse Markov chain; a few lines of the corpus are blank."""

    def __init__(self, seed=1):
        self.trans = torch.randint(1, VOCAB, (VOCAB, 3), generator=torch.Generator().manual_seed(1234))
        self.g = torch.Generator().manual_seed(seed)

    def step_batch(self, step=None):
        """A variable number of documents per step, length-bucketed into micro-batches."""
        g = self.g
        if step is not None and step % SHARD_STEPS == SHARD_STEPS - 1:
            return []                                                 # shard boundary: nothing left
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


@torch.inference_mode()
def evaluate(model, val_batches):
    model.eval()
    total, count = 0.0, 0.0
    for tokens, targets in val_batches:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(tokens, targets)
        total += float(out["nll_sum"])
        count += float(out["n_tokens"])
    model.train()
    return total / max(count, 1.0)


def main():
    model = TokenShiftLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    stream = DocStream()
    val_batches = [mb for _ in range(3) for mb in DocStream(seed=99).step_batch()]
    t0 = time.time()
    skipped_micro, empty_steps = 0, 0
    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            micro_batches = stream.step_batch(step)
            # normalise by the tokens of the whole step, not per micro-batch
            step_tokens = sum(int((targets != PAD).sum()) for _, targets in micro_batches)
            if step_tokens == 0:
                empty_steps += 1
                continue                      # nothing to learn from: no backward, no step
            step_loss = 0.0
            for tokens, targets in micro_batches:
                if not (targets != PAD).any():
                    skipped_micro += 1
                    continue                  # a micro-batch of padding only (blank lines)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(tokens, targets)
                    loss = out["nll_sum"] / step_tokens
                scaler.scale(loss).backward()
                step_loss += loss.item()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step % LOG_EVERY == 0:
                print(f"step {step:3d} loss {step_loss:.4f} micro {len(micro_batches)} tokens {step_tokens:4d} "
                      f"grad_norm {float(grad_norm):.3f} scale {scaler.get_scale():.0f} "
                      f"lr {lr_at(step):.2e}")
            if step % EVAL_EVERY == EVAL_EVERY - 1:
                print(f"step {step:3d} val_loss {evaluate(model, val_batches):.4f}")
    print(f"done in {time.time() - t0:.1f}s, final scale {scaler.get_scale():.0f}, "
          f"skipped micro-batches {skipped_micro}, empty steps {empty_steps}")
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
