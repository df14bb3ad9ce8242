"""EXPECT: AMP004,AMP101,AMP105
MAY: AMP102,AMP110,AMP111
FAULT: machine-state classifier on raw sensor readings in physical units (rpm ~2950,
hPa ~1013, K ~300 ...), trained in fp16 autocast with a GradScaler. The model's
hand-written LayerNorm `ChannelNorm` (module path `norm`, forward at line 51, marked
`# <-- FAULT`) computes `x.mean(-1)` and `x.var(-1)` on the fp16 output of `embed`
without an upcast. The per-sample variance of `embed`'s output is ~1e5-1e6, beyond
65504, so `var` (fp16 in, fp16 out) returns inf on every step from step 0 although
its inputs are finite (max |x| ~ 2000). rsqrt(inf) = 0 turns the normalised
activations into exact zeros: the forward and the loss stay finite, but every later
step gives `embed` (and `norm.weight`) exactly-zero gradients, so the front-end never
learns. At step 0 (scale 65536) the norm's backward also overflows and the scaler skips
that one step (checked with plain torch, no guard).
Why these codes (from the pages): AMP004 runtime = "a reduction's input and output are
both fp16/bf16" (mean and var in `norm`, watched steps 0-7). AMP101 = "first op whose
output holds NaN/Inf while its inputs were finite": under trace="auto" the skipped step
0 is replayed with per-op checks (AMP101 page: "a GradScaler skipping the step" triggers
the replay), which must pin `var` in module `norm`. AMP105 = "a layer whose largest
gradient magnitude is below 1e-10 (including a layer whose gradients are all exactly
zero)": `embed` from step 1 on. MAY: AMP102 (inf vs the >60000 test), AMP110/AMP111
(sampled once per-op checks are on after the anomaly: `var + eps` with var huge, and
reductions over values from ~1e-2 to ~2e3).
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

# coolant K, pressure hPa, spindle rpm, vibration um, current A, power factor,
# mains Hz, oil temp K, torque Ncm, ambient C, humidity g/m3, feed mm/min
TYPICAL = torch.tensor([300., 1013., 2950., 45., 12., 0.8, 60., 410., 1500., 22., 5., 700.])


class ChannelNorm(nn.Module):
    """LayerNorm spelled out so that the exported graph has no fused op."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # <-- FAULT: fp16 var > 65504 -> inf
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class MachineStateNet(nn.Module):
    def __init__(self, n_in=12, n_cls=3):
        super().__init__()
        self.embed = nn.Linear(n_in, 128)
        self.norm = ChannelNorm(128)
        self.mlp = nn.Sequential(nn.Linear(128, 64), nn.GELU())
        self.head = nn.Linear(64, n_cls)

    def forward(self, x):
        return self.head(self.mlp(F.gelu(self.norm(self.embed(x)))))


def batch(n=64):
    y = torch.randint(0, 3, (n,))
    x = TYPICAL * (1 + 0.05 * torch.randn(n, 12))
    x[y == 1, 0] *= 1.15          # overheating: coolant temperature up
    x[y == 2, 3] *= 2.0           # bearing wear: vibration doubles
    return x, y


model = MachineStateNet()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu")

with amp_runtime.guard(policy="record") as g:
    for step in range(60):
        x, y = batch()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
