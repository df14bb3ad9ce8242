"""EXPECT: AMP101,AMP112
MAY: AMP102
FAULT: a small audio-event classifier (token embedding, one self-attention block whose
scores are `q @ k.transpose(-2, -1)` without the 1/sqrt(d) scaling, a linear head) trains
in fp16 autocast with `GradScaler("cpu", init_scale=4096)` and gradient accumulation over
4 micro-batches (loss / 4, one `scaler.step` + `scaler.update` per 4). In step 6 the LAST
micro-batch (call 4 of 4) contains one clip whose features were not divided by the
pre-amp gain (x400): its q and k reach ~1000 and ~570 (finite), and the unscaled attention scores
overflow fp16 in the `q @ k^T` matmul (~2e5 -> inf); softmax turns the inf rows into NaN,
that micro-batch's loss is NaN, and GradScaler skips step 6. The first three
micro-batches of step 6 and every other step are healthy, and no other step is skipped
(checked with plain torch, `--plain`).

Why these codes (pages):
- AMP101: "where the step called the model more than once, as with gradient accumulation
  ..., details["call"] and details["calls"] say which call, 'in embed (forward call 3 of
  4)'" -> the matmul in module `attn`, step 6, the `scores = q @ k...` line, call 4 of 4.
- AMP112: "Checks the tensor that backward() starts from" -> the 4th backward of step 6
  (the accumulation loop's backward line), step 6.
- DESIGN: "Gradient accumulation is judged once per step, not per micro-batch" -> the
  step number is 6, never a micro-batch index (24..27).
Must NOT fire: AMP103 (skipped by the scaler), AMP108/AMP107 (one halving, 4096 -> 2048),
AMP109, AMP104, AMP010 (a scaler is active for every backward), AMP004 (no fp16 reduction:
the head reads token 0, the loss upcasts), and nothing in steps other than 6.
MAY: AMP102 - the replay traces every op of step 6; the overflowing matmul's output max is
inf, and other ops of that micro-batch (q, k, v, the softmax input) are below 6e4 in
plain torch, but the page does not say whether inf also counts as "|x| > 60000".
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 16
ACCUM = 4
FAULT_STEP, FAULT_MICRO = 6, 3


def make_data():
    gen = torch.Generator().manual_seed(4)
    proto = torch.randn(3, 8, generator=gen)
    batches = []
    for step in range(STEPS):
        micro = []
        for m in range(ACCUM):
            y = torch.randint(0, 3, (8,), generator=gen)
            x = 0.7 * torch.randn(8, 12, 8, generator=gen) + proto[y][:, None, :]
            if (step, m) == (FAULT_STEP, FAULT_MICRO):
                x[3] = x[3] * 400.0                      # gain not divided out
            micro.append((x, y))
        batches.append(micro)
    return batches


class SelfAttention(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h):
        q, k, v = self.q(h), self.k(h), self.v(h)
        scores = q @ k.transpose(-2, -1)  # <-- L:scores
        return scores.softmax(dim=-1) @ v


class ClipClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = SelfAttention()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.attn(h)  # <-- L:attn_call
        return self.head(h[:, 0])


def train(batches, diag=None):
    torch.manual_seed(0)
    model = ClipClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    losses, scales = [], []
    for step, micro in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        for m, (x, y) in enumerate(micro):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)  # <-- L:model_call
                loss = F.cross_entropy(logits.float(), y) / ACCUM
            scaler.scale(loss).backward()  # <-- L:backward
            losses.append(loss.item())
            if diag is not None:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                    h = model.embed(x)
                    q, k = model.attn.q(h), model.attn.k(h)
                    diag.append((step, m, loss.item(), q.abs().max().item(), k.abs().max().item(),
                                 (q @ k.transpose(-2, -1)).abs().max().item()))
        scaler.step(opt)
        scaler.update()  # <-- L:update
        scales.append(scaler.get_scale())
    return model, losses, scales


# ---------------------------------------------------------------- harness
def same(a, b):
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def same_list(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def marker_lines():
    out = {}
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if "# <-- L:" in line and "out[" not in line:
                out[line.split("# <-- L:")[1].strip()] = i
    return out


def main():
    batches = make_data()
    diag = []
    ref_model, ref_losses, ref_scales = train(batches, diag)
    for step, m, loss, qm, km, sm in diag:
        if step in (5, 6, 7):
            print(f"plain step {step} micro {m}: loss={loss:.4g} |q|max={qm:.4g} |k|max={km:.4g} |scores|max={sm:.4g}")
    print("plain scales:", ref_scales)
    if "--plain" in sys.argv:
        return
    ref_model, ref_losses, ref_scales = train(batches)
    with amp_runtime.guard(policy="record") as g:
        model, losses, scales = train(batches)
    print("LOSSES_MATCH", same_list(ref_losses, losses) and same_list(ref_scales, scales))
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    print("WEIGHTS_MATCH", all(same(ref_sd[k], sd[k]) for k in ref_sd))
    print("LINES", marker_lines())
    for e in g.report.events:
        extra = {k: e.details[k] for k in ("call", "calls", "replayed") if k in (e.details or {})}
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} {extra} | {e.message}")
    print(g.report.summary())
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
