"""EXPECT: AMP103 AMP112
MAY: AMP104

FAULT: the mean-teacher token tagger trained in bf16 autocast without a GradScaler
(correct for bf16), EMA teacher updated after every step. The consistency term is the
Euclidean distance between student and teacher features written as
(s - t).pow(2).sum(-1).sqrt() with no epsilon. The teacher is a deepcopy of the student,
and the student's input differs only where token dropout hit (15%), so at step 0 most
valid tokens have distance exactly 0, where sqrt's derivative is infinite: the backward
gives 0 * inf = NaN (the page's own sqrt-at-0 example). Checked without the guard: the
forward and the loss are finite at step 0, the gradients of every student parameter
are NaN, AdamW applies them (no scaler), all weights and, through the EMA update, the
teacher become NaN, and the loss is NaN at every step from 1 to 41.
- AMP103 (nonfinite-grad page): NaN gradients reach optimizer.step at step 0 with no
  GradScaler to catch them (the replay's backward finds the sqrt; a finite forward).
- AMP112 (nonfinite-loss page): the loss is NaN when backward starts at steps 1-41 (the
  replay names a parameter already NaN before the forward).
MAY: AMP104 (the total norm is NaN from step 0 on: the pages do not say whether a
non-finite norm counts as above 100/1000).
Not expected: AMP101 (step 0's forward is finite; later every op only propagates NaN
weights, never a finite-input op turning non-finite), AMP010 (no scaler is correct for
bf16), AMP106-AMP109 (no scaler; bf16 has fp32's range), code-pattern rules (the sum and
sqrt run on fp32 features, the Function runs in fp32).
"""
import copy
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

VOCAB, DIM, TAGS, PAD, UNK = 1000, 64, 12, 0, 1
CURRICULUM = [(16, False, 12), (48, True, 30)]  # (max_len, variable lengths, steps)
BATCH, EMA_DECAY, CONSISTENCY_WEIGHT = 16, 0.99, 0.5


class L2Normalize(torch.autograd.Function):
    """Row-wise x / ||x|| with a hand-written backward (no autograd graph for the norm)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, eps=1e-6):
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        y = x / norm.clamp_min(eps)
        ctx.save_for_backward(y, norm)
        ctx.eps = eps
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        y, norm = ctx.saved_tensors
        # d(x/|x|)/dx applied to grad: (grad - y <y, grad>) / |x|
        tangential = grad - y * (y * grad).sum(dim=-1, keepdim=True)
        return tangential / norm.clamp_min(ctx.eps), None


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.mix = nn.Conv1d(DIM, DIM, kernel_size=3, padding=1)
        self.head = nn.Linear(DIM, TAGS)

    def forward(self, tokens):
        feats = L2Normalize.apply(self.proj(self.embed(tokens)))
        feats = feats.masked_fill((tokens == PAD).unsqueeze(-1), 0.0)
        ctx = self.mix(feats.transpose(1, 2)).transpose(1, 2)
        return feats, self.head(F.gelu(ctx) + feats)


def make_batch(max_len, variable, gen):
    tokens = torch.randint(2, VOCAB, (BATCH, max_len), generator=gen)
    prev = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), tokens[:, :-1]], dim=1)
    tags = (tokens + prev) % TAGS
    if variable:
        lengths = torch.randint(max_len // 4, max_len + 1, (BATCH,), generator=gen)
        pad = torch.arange(max_len)[None, :] >= lengths[:, None]
        tokens = tokens.masked_fill(pad, PAD)
        tags = tags.masked_fill(pad, -100)
    return tokens, tags


def token_dropout(tokens, gen, p=0.15):
    drop = (torch.rand(tokens.shape, generator=gen) < p) & (tokens != PAD)
    return tokens.masked_fill(drop, UNK)


student = Tagger()
teacher = copy.deepcopy(student).requires_grad_(False)
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.01)
gen = torch.Generator().manual_seed(1)

with amp_runtime.guard(policy="record", model=student) as g:
    step = 0
    for max_len, variable, steps in CURRICULUM:
        for _ in range(steps):
            tokens, tags = make_batch(max_len, variable, gen)
            valid = tokens != PAD
            with torch.autocast("cpu", dtype=torch.bfloat16):
                s_feats, logits = student(token_dropout(tokens, gen))
                with torch.no_grad():
                    t_feats, _ = teacher(tokens)
                task = F.cross_entropy(logits.float().flatten(0, 1), tags.flatten(), ignore_index=-100)
                dist = (s_feats - t_feats).pow(2).sum(dim=-1).sqrt()
                loss = task + CONSISTENCY_WEIGHT * dist[valid].mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for t_p, s_p in zip(teacher.parameters(), student.parameters()):
                    t_p.mul_(EMA_DECAY).add_(s_p, alpha=1 - EMA_DECAY)
            if step % 10 == 0:
                print(f"step {step} len {max_len} loss {loss.item():.4f}")
            step += 1

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
