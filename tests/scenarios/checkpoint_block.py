"""EXPECT: AMP101,AMP112
MAY: AMP102,AMP110

FAULT: a small DiT-style diffusion denoiser (2-D data, 3 adaLN blocks with a gate:
`x + gate * mlp(modulate(norm(x), shift, scale))`) trained with fp16 CPU autocast and
GradScaler("cpu"); every block runs under activation checkpointing,
`torch.utils.checkpoint.checkpoint(blk, x, c, use_reentrant=False)`. The time embedding is
`nn.Linear(1, d)` on t / T with T = 4000 (improved-DDPM's 4000 steps). At step 4 (0-based)
the timestep sampler takes its low-discrepancy branch, which forgets the `/ T`
(`sample_t`, the line marked `# FAULT: raw timesteps`): t reaches ~4000, the adaLN
gate reaches ~780 and the MLP output ~330, and inside the checkpointed block 0 the fp16
product `gate * self.mlp(...)` (AdaLNBlock.forward, line marked `# FAULT OP`, module
`blocks.0`) is inf in 31 entries while its inputs are finite (checked with plain torch,
same shapes; every op before it is finite). The loss of step 4 is inf/NaN, the GradScaler
skips step 4; all other steps are finite and not skipped.

Codes from the pages: AMP112 ("the loss is NaN/Inf when backward starts") and AMP101
(trace="auto": the failing step is replayed with per-op checks "so AMP101 names the op of
the step where it happened"; index.md limits mention checkpointing only for reentrant
checkpointing and backward-only faults: "Reentrant activation checkpointing
(use_reentrant=True) makes each checkpointed segment one autograd node: a backward fault
inside one is named as that node" -- this is a forward fault under non-reentrant
checkpointing, so the op, module `blocks.0` and line must be named). Not AMP103 (skipped
by the scaler), not AMP108/AMP109 (one skip). MAY: AMP102 (same op's finite entries, and
per-op checks after the anomaly; checkpoint recomputation in backward re-runs the block's
ops), AMP110 (fp16 residual add `x + ...`, sampled on traced steps after the anomaly).
Losses and weights must equal an unguarded run (bit-identical).
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

T, STEPS, BS, D, BAD_STEP = 4000, 12, 64, 64, 4


class AdaLNBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.ada = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, c):
        shift, scale, gate = self.ada(F.silu(c)).chunk(3, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        return x + gate * self.mlp(h)  # FAULT OP: fp16 gate * mlp overflows for raw t


class Denoiser(nn.Module):
    def __init__(self, d=D, depth=3):
        super().__init__()
        self.inp = nn.Linear(2, d)
        self.temb = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([AdaLNBlock(d) for _ in range(depth)])
        self.out = nn.Linear(d, 2)

    def forward(self, x, t):
        c = self.temb(t)
        h = self.inp(x)
        for blk in self.blocks:
            h = checkpoint(blk, h, c, use_reentrant=False)
        return self.out(h)


def sample_t(gen, step):
    if step == BAD_STEP:  # low-discrepancy sampler branch
        u = (torch.arange(BS) + torch.rand(1, generator=gen)) / BS
        return (u * T).floor()[:, None]  # FAULT: raw timesteps, the / T is missing
    return torch.randint(0, T, (BS, 1), generator=gen).float() / T


def make_data():
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        angle = torch.rand(BS, generator=gen) * 6.28
        x0 = torch.stack([angle.cos(), angle.sin()], 1) * (1 + 0.1 * torch.randn(BS, 1, generator=gen))
        t = sample_t(gen, step)
        noise = torch.randn(BS, 2, generator=gen)
        tt = t.clamp(max=1.0)
        xt = (1 - tt).sqrt() * x0 + tt.sqrt() * noise
        out.append((xt, t, noise))
    return out


def build():
    torch.manual_seed(0)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, scaler


def train(model, opt, scaler, data):
    losses, scales = [], []
    for xt, t, noise in data:
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(xt, t)
            loss = F.mse_loss(pred.float(), noise)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales


def same(a, b):
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


def fmt(e):
    d = e.details or {}
    return (f"{e.code} sev={e.severity} step={e.step} module={e.module!r} op={e.op!r} source={e.source!r} "
            f"details={str({k: d[k] for k in sorted(d) if k != 'traceback'})[:500]}")


data = make_data()
ref_model, ref_opt, ref_scaler = build()
ref_losses, ref_scales = train(ref_model, ref_opt, ref_scaler, data)
print("unguarded losses", [round(v, 4) for v in ref_losses])
print("unguarded scales", ref_scales)

model, opt, scaler = build()
with amp_runtime.guard() as g:
    losses, scales = train(model, opt, scaler, data)

print("LOSSES_MATCH", same(ref_losses, losses), "SCALES_MATCH", ref_scales == scales,
      "WEIGHTS_MATCH", all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters())))
for e in g.report.events:
    print("EVENT", fmt(e))
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
