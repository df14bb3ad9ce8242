"""EXPECT: AMP007
MAY: none
FAULT: a small transformer text classifier (embedding, one self-attention block with a
hand-written attention, LayerNorm, MLP; CPU autocast float16 + GradScaler) masks padded keys
with `scores = scores.masked_fill(pad[:, None, None, :], -1e9)` -- the copied-layer bug of
REAL_WORLD_IDIOMS.md.  As in HF-style code the mask is applied only when the batch has padding
(`if pad.any():`).  The loader buckets by length: steps 0-4 are full-length batches, the first
padded batch arrives at step 5.  In fp16 `masked_fill` with -1e9 raises
`RuntimeError: value cannot be converted to type c10::Half without overflow` (checked with
plain torch below): the run dies at step 5 after 5 good optimizer steps, in both runs, and the
exception leaves the guard's `with` block (the script catches it outside).
Why this code (quotes from docs/rules/AMP007.md): "Flags a constant whose magnitude exceeds
65504 (`-1e9`, ...) used as a fill on a tensor that can be fp16: `masked_fill` ..."; "At run
time the guard reports such a constant meeting an fp16 tensor"; its "Why is it bad" names
exactly this: "`scores.masked_fill(mask, -1e9)` on an fp16 tensor raises `RuntimeError: value
cannot be converted to type at::Half without overflow`".  Step 5 is a watched step ("the
first `Thresholds.watch_steps` (default 8)"), so the code-pattern rule sees the call:
expected at step 5, module of the attention, op masked_fill, the masked_fill line.
(Open point, noted in the README: the runtime sentence ends "(the result holds inf)"; here
there is no result, the op raises.  I read the rule as covering the call itself.)
Must NOT fire: AMP101 (no op produced inf: the op raised), AMP100 ("Your own calls run
exactly once, and their exceptions reach you unchanged"), AMP112/AMP103/AMP107-109 (steps 0-4
are healthy, no scaler skip), AMP004 (pooling takes the first token, no fp16 reduction),
AMP002/AMP010.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS = 20
VOCAB, D, T, B, CLASSES, PAD = 64, 32, 16, 16, 3, 0


class SelfAttention(nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pad):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        if pad.any():
            scores = scores.masked_fill(pad[:, None, None, :], -1e9)
        att = scores.softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.ln1 = nn.LayerNorm(D)
        self.attn = SelfAttention(D)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tokens):
        pad = tokens == PAD
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = h + self.attn(self.ln1(h), pad)
        h = h + self.mlp(self.ln2(h))
        return self.head(h[:, 0])  # first token ([CLS]) pooling


def build():
    torch.manual_seed(0)
    return Classifier()


gen = torch.Generator().manual_seed(1)
TOKENS = torch.randint(1, VOCAB, (STEPS, B, T), generator=gen)
LABELS = TOKENS[..., 1] % CLASSES
for s in range(5, STEPS):  # bucketed loader: shorter sequences (right-padded) from step 5 on
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    TOKENS[s][torch.arange(T)[None, :] >= lengths[:, None]] = PAD
FIRST_PADDED = next(s for s in range(STEPS) if bool((TOKENS[s] == PAD).any()))


def train(model, losses):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(TOKENS[step])
            loss = F.cross_entropy(logits.float(), LABELS[step])
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.detach().clone())


def run(model, guarded=False):
    losses, crash, g = [], None, None
    try:
        if not guarded:
            train(model, losses)
        else:
            with amp_runtime.guard(policy="record") as g:
                train(model, losses)
    except RuntimeError as exc:  # the exception leaves the guard's block
        crash = (len(losses), type(exc).__name__, str(exc))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, crash, g


def precheck():
    x = torch.randn(2, 4, 4, 4).half()
    try:
        x.masked_fill(torch.ones(2, 1, 1, 4, dtype=torch.bool), -1e9)
        print("PRECHECK fp16 masked_fill(-1e9) did not raise")
    except RuntimeError as exc:
        print("PRECHECK fp16 masked_fill(-1e9) raises:", exc)
    losses, _, crash, _ = run(build())
    print("PRECHECK first padded batch at step", FIRST_PADDED, "| losses before the crash",
          [round(l.item(), 4) for l in losses], "| crash", crash)
    assert FIRST_PADDED == 5 and crash is not None and crash[0] == 5
    with torch.autocast("cpu", dtype=torch.float16):  # the scores really are fp16 there
        m = build()
        h = m.ln1(m.embed(TOKENS[5]) + m.pos)
        print("PRECHECK dtype of qkv output under autocast:", m.attn.qkv(h).dtype)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    precheck()
    ref_losses, ref_weights, ref_crash, _ = run(build())
    losses, weights, crash, g = run(build(), guarded=True)
    print("CRASH_MATCH", crash == ref_crash, crash)
    print("LOSSES_MATCH", len(losses) == len(ref_losses) and all(same(a, b) for a, b in zip(losses, ref_losses)))
    print("WEIGHTS_MATCH", weights.keys() == ref_weights.keys() and all(same(weights[k], ref_weights[k]) for k in weights))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} :: {e.message}")
    print("COUNTS", json.dumps(g.report.to_json().get("counts", {}), sort_keys=True))
    print("EVENTS", json.dumps(sorted(set(g.report.codes()))))


if __name__ == "__main__":
    main()
