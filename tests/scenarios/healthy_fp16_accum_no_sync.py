"""EXPECT: none
MAY: none
FAULT: none -- a healthy control.  A DDP-wrapped MLP classifier (a real
`DistributedDataParallel` over a one-process gloo group, as `torchrun --nproc-per-node 1`
gives) trains in CPU autocast float16 with a GradScaler and gradient accumulation, written the
way DDP trainers write it: 4 micro-batches per optimizer step, `model.no_sync()` on every
micro-batch but the last (`contextlib.nullcontext()` on the last), the loss divided by the
number of micro-batches, the next micro-batch fetched between the forward and the backward
(nanoGPT's prefetch), then `scaler.unscale_(optimizer)`, `clip_grad_norm_(..., 1.0)`,
`scaler.step`, `scaler.update`, `zero_grad(set_to_none=True)`; 12 optimizer steps = 48
micro-steps.  Checked with plain torch below: all losses finite, no step skipped, unscaled
gradient norms between 0.1 and 10, and at step 0 (AMP106's first sampled step) every weight
matrix has far below 1% of its nonzero gradients at fp16's smallest subnormal, with no
gradient flushed against an fp32 backward.
Why nothing (quotes from docs): DESIGN.md "Gradient accumulation is judged once per step, not
per micro-batch"; REAL_WORLD_IDIOMS "Gradient accumulation: several forward/backward
micro-steps per optimizer step, the loss divided by the number of micro-steps, the data
loader fetched between forward and backward" and "Conversely not every `ctx` is autocast
(`ctx = model.no_sync`)"; AMP005 "It stays silent when `unscale_` is called" before the clip;
AMP006 is not a plain `optimizer.step()`; AMP008: backward runs after the autocast block.
Anything reported here is a false alarm.
"""
import contextlib
import copy
import json
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS, ACCUM, MICRO_B = 12, 4, 16

gen = torch.Generator().manual_seed(1)
N = STEPS * ACCUM + 1
X = torch.randn(N, MICRO_B, 20, generator=gen)
PROTOS = torch.randn(4, 20, generator=gen)
Y = (X @ PROTOS.T).argmax(-1)


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def loader():
    for i in range(N):
        yield X[i], Y[i]


def train(module, log=None):
    model = DDP(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    batches = loader()
    x, y = next(batches)
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            sync_ctx = contextlib.nullcontext() if last else model.no_sync()
            with sync_ctx:
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(x)
                    loss = F.cross_entropy(logits.float(), y) / ACCUM
                x, y = next(batches)  # prefetch while the backward runs
                scaler.scale(loss).backward()
            losses.append(loss.detach().clone())
        if log is not None and step == 0:
            log.append(("step0-grads", [(n, p.grad.detach().clone()) for n, p in module.named_parameters()],
                        scaler.get_scale()))
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if log is not None:
            log.append((step, float(norm), before, scaler.get_scale()))
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def precheck():
    log = []
    ref0 = build()
    losses, _ = train(build(), log)
    _, grads, scale = log[0]
    # fp32 backward of the same first 4 micro-batches on the same initial weights
    for i in range(ACCUM):
        (F.cross_entropy(ref0(X[i]), Y[i]) / ACCUM * scale).backward()
    for (name, g16), (_, p32) in zip(grads, ref0.named_parameters()):
        if g16.dim() < 2:
            continue
        nonzero = g16 != 0
        at_min = int((g16.abs() == 2 ** -24).sum())
        flushed = int(((p32.grad != 0) & (g16 == 0)).sum())
        print(f"PRECHECK step 0 {name}: at 2^-24 {at_min}/{int(nonzero.sum())} -> estimate "
              f"{at_min / 2 / max(1, int(nonzero.sum())):.4%}; flushed vs fp32 {flushed}")
        assert at_min / 2 / int(nonzero.sum()) < 0.01
    rows = log[1:]
    for step, norm, before, after in rows:
        print(f"PRECHECK step {step:2d} unscaled grad norm {norm:.3g} scale {before} -> {after}")
    assert all(math.isfinite(l.item()) for l in losses)
    assert all(after >= before for _, _, before, after in rows), "no skipped step expected"
    assert all(0.1 < norm < 10 for _, norm, _, _ in rows)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main():
    store = tempfile.mktemp(prefix="scenario_ddp_")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        precheck()
        ref_losses, ref_weights = train(build())
        module = build()
        with amp_runtime.guard(policy="record", model=module) as g:
            losses, weights = train(module)
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.remove(store)
    print("LOSSES_MATCH", len(losses) == len(ref_losses) and all(same(a, b) for a, b in zip(losses, ref_losses)))
    print("WEIGHTS_MATCH", weights.keys() == ref_weights.keys() and all(same(weights[k], ref_weights[k]) for k in weights))
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} :: {e.message}")
    print("COUNTS", json.dumps(g.report.to_json().get("counts", {}), sort_keys=True))
    print("EVENTS", json.dumps(sorted(set(g.report.codes()))))


if __name__ == "__main__":
    main()
