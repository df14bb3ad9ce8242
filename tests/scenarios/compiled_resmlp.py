"""EXPECT: AMP101,AMP112
MAY: AMP110
FAULT: a residual-MLP classifier is wrapped in `torch.compile(model, backend="eager")`
(the loop calls the compiled wrapper; the guard gets `model=` the compiled module) and
trained in fp16 autocast with an enabled GradScaler, `unscale_` before `clip_grad_norm_`,
a cosine LR schedule and an evaluation every 10 steps under `model.eval()` +
`torch.no_grad()` (dynamo recompiles for eval mode) before `model.train()`. At step 12
(only) the batch comes from a shard whose preprocessing forgot to drop the raw
`event_ts` column (unix seconds, 1.7e9, in feature 39): under fp16 autocast the stem's
GEMM gets that value cast beyond 65504, so the output of `linear` in module `stem` (the
`h = self.stem(x)` line of `ResMLP.forward`) holds inf/NaN while its (fp32) inputs were
finite; the loss is NaN when `scaler.scale(loss).backward()` starts (AMP112, step 12) and
the scaler skips the step. Per the docs the per-op mode is off for compiled code, but the
step-level check (AMP112) goes on, and the trace="auto" replay of the failing step runs
the compiled model's original module eagerly with per-op checks, so AMP101 names op
`linear`, module `stem` (no `_orig_mod` in the name), step 12, details["replayed"] true.
Steps 0-11 and 13-29 are healthy (no skip, total grad norm < 3). One skip only: no
AMP108/AMP109. MAY AMP110: the replay's per-op checks see the fp16 residual additions
after the NaN; whether non-finite operands are judged for absorption is not said.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

BAD_SHARD_STEP = 12


class ResidualBlock(nn.Module):
    def __init__(self, d, expansion=2, p_drop=0.1):
        super().__init__()
        self.fc1 = nn.Linear(d, d * expansion)
        self.fc2 = nn.Linear(d * expansion, d)
        self.drop = nn.Dropout(p_drop)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


class ResMLP(nn.Module):
    def __init__(self, d_in=40, d=64, depth=3, n_classes=5):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(ResidualBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, n_classes)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(F.relu(h))


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(5, 40, generator=torch.Generator().manual_seed(99)) * 1.5
    y = torch.randint(0, 5, (n,), generator=g)
    x = centers[y] + torch.randn(n, 40, generator=g)
    return x, y


@torch.no_grad()
def evaluate(model, x, y, dtype):
    model.eval()
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x)
    acc = (logits.float().argmax(-1) == y).float().mean().item()
    loss = F.cross_entropy(logits.float(), y).item()
    model.train()
    return loss, acc


def main(steps=30, batch_size=64, dtype=torch.float16):
    x_tr, y_tr = make_split(2048, 1)
    x_va, y_va = make_split(256, 2)
    model = ResMLP()
    model = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == torch.float16))
    g_data = torch.Generator().manual_seed(3)
    history = []
    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(steps):
            idx = torch.randint(0, x_tr.shape[0], (batch_size,), generator=g_data)
            x, y = x_tr[idx], y_tr[idx]
            if step == BAD_SHARD_STEP:
                x = x.clone()
                x[:, 39] = 1.7e9 + torch.arange(batch_size) * 60.0   # raw event_ts leaked
            with torch.autocast("cpu", dtype=dtype):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            if step % 10 == 9:
                history.append((step, loss.item(), float(grad_norm),
                                *evaluate(model, x_va, y_va, dtype)))
    assert history[-1][-1] > 0.5, history      # it learns
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
