"""EXPECT: none

HEALTHY: a tiny model (LayerNorm -> MLP with dropout, 5.3k parameters) trained 300 steps
with fp16 CPU autocast + GradScaler("cpu") (default init scale 65536, growth_interval
2000), AdamW, a warm-up + cosine LambdaLR schedule, `scaler.unscale_` then
`clip_grad_norm_(..., 1.0)`, `zero_grad(set_to_none=True)`, fresh batches every step
(noisy regression: targets have irreducible noise, so gradients never vanish). Checked
with plain torch: no step is skipped (the scale stays 65536), losses and grads finite.
At steps 50 and 300 the loop prints `len(g.report.events)`, `len(g.report)` and the
process RSS (after gc.collect()); the unguarded reference prints the same RSS points.

Why none: no non-finite value (AMP101/AMP103/AMP112), no skipped step and a constant
scale (AMP107/AMP108/AMP109: "5 consecutive decreases, or scale < init/100, or < 128 and
falling"; AMP109's window counts skipped steps), the gradient norm stays far below 100
(AMP104) and above 1e-6 (AMP105), the default scale 65536 lifts these gradients (AMP106,
checked every 32nd step), no fp16 value near 60000 and per-op checks never switch on
(AMP102/AMP110/AMP111), the code patterns are all correct (unscale_ before the clip,
scaler.step + update, loss in the autocast block, backward outside it, no casts, no tiny
eps, no fills). index.md "Bounded memory ... the report keeps the first 10 occurrences and
the latest one": with no events at all the report must stay empty, and the guard's kept
step state ("until every device reading of its step has been judged ... on the CPU until
the step ends") must not accumulate: the guarded RSS growth from step 50 to 300 must stay
within 2 MiB of the unguarded run's growth (printed as MEMORY_OK).
Losses and weights must equal the unguarded run's.
"""
import gc
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS, BS, WARMUP = 300, 32, 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_kib():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE // 1024


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.mlp = nn.Sequential(nn.Linear(12, 96), nn.GELU(), nn.Dropout(0.05), nn.Linear(96, 40), nn.GELU(),
                                 nn.Linear(40, 3))

    def forward(self, x):
        return self.mlp(self.norm(x))


def build():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / WARMUP if s < WARMUP else 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (STEPS - WARMUP))))
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, sched, scaler


def train(model, opt, sched, scaler, report=None, tag=""):
    gen = torch.Generator().manual_seed(77)
    w = torch.randn(12, 3, generator=gen)
    torch.manual_seed(1)
    losses, rss = [], {}
    skipped = 0
    for step in range(STEPS):
        x = torch.randn(BS, 12, generator=gen)
        y = torch.tanh(x @ w) + 0.3 * torch.randn(BS, 3, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if step + 1 in (50, 300):
            rss[step + 1] = rss_kib()
            extra = "" if report is None else f" len(g.report.events)={len(report.events)} len(g.report)={len(report)}"
            print(f"{tag} step {step + 1}: RSS {rss[step + 1]} KiB{extra}")
    return losses, rss, skipped


ref_model, ref_opt, ref_sched, ref_scaler = build()
ref_losses, ref_rss, ref_skipped = train(ref_model, ref_opt, ref_sched, ref_scaler, tag="unguarded")
print("unguarded: skipped steps", ref_skipped, "scale", ref_scaler.get_scale(),
      "loss first/last", round(ref_losses[0], 4), round(ref_losses[-1], 4))

model, opt, sched, scaler = build()
with amp_runtime.guard() as g:
    losses, rss, skipped = train(model, opt, sched, scaler, report=g.report, tag="guarded")

grow_ref = ref_rss[300] - ref_rss[50]
grow = rss[300] - rss[50]
print(f"RSS growth 50->300: unguarded {grow_ref} KiB, guarded {grow} KiB; MEMORY_OK {grow - grow_ref <= 2048}")
print("LOSSES_MATCH", losses == ref_losses,
      "WEIGHTS_MATCH", all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters())),
      "skipped", skipped, "final len(g.report.events)", len(g.report.events))
for e in g.report.events:
    print("EVENT", e.code, e.severity, e.step, e.module, e.op, e.source, e.message[:200])
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
