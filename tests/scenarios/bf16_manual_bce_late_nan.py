"""EXPECT: AMP101 AMP103 AMP112
MAY: AMP104 AMP105
FAULT: twin of h3_bf16_sensor_clf_fp32_stats.py (same data, model, seed, bf16 autocast,
AdamW, no GradScaler, fp32 running statistics) whose model computes its binary
cross-entropy by hand inside its forward: p = sigmoid(logits) in bf16, then
-(y*log(p) + (1-y)*log1p(-p)).mean(). bf16 has 8 significant bits, so sigmoid(z) rounds to
exactly 1.0 once z > ~6.24. As the classifier grows confident, the largest positive logit
is 6.22 on steps 0..163 and 6.59 on step 164: there log1p(-1.0) = -inf from finite inputs,
(1-y) * -inf = 0 * -inf = NaN, and the loss is NaN when backward starts on step 164
(AMP112, docs/rules/AMP112.md). Without a scaler AdamW steps on the NaN gradients (all 6
parameters' gradients are non-finite: AMP103, docs/rules/AMP103.md), every weight becomes
NaN, and every later step (165..399) has a NaN loss. The loss is computed inside the
model's forward (the model returns (logits, loss)), so the replay of step 164, which on
the CPU runs before the optimizer step, re-runs the op that produced the first non-finite
value: torch.log1p in SensorClassifier.forward, whose input (-p = -1.0) is finite (verified
with a TorchFunctionMode: the first op of the run with a non-finite output from finite
inputs is log1p, on step 164): AMP101 (docs/rules/AMP101.md and "Replaying the failing
step" in docs/index.md). Steps 0..163 are clean (losses finite, grad norm 0.085..0.32).
AMP104/AMP105 are only MAYs: from step 164 on, gradient norms are NaN; the pages do not say whether a NaN total
norm counts as above 100 (AMP104) or below 1e-6 (AMP105).
Not AMP110/AMP111: the bf16 values meet the fp32 targets, so the products, the + and the
mean run in fp32; no bf16 add or reduction.
"""
import json

import torch
from torch import nn

import amp_runtime

STEPS = 400
N_SENSORS, CHANNELS = 16, 4
STATS_DTYPE = torch.float32


class RunningRMS(nn.Module):
    """Scales a sensor's channels by a slow running estimate of their mean square."""

    def __init__(self, channels, decay=0.9999, dtype=STATS_DTYPE):
        super().__init__()
        self.decay = decay
        self.register_buffer("mean_sq", torch.ones(channels, dtype=dtype))

    def forward(self, x):
        if self.training:
            batch_ms = x.detach().pow(2).mean(0).to(self.mean_sq.dtype)
            self.mean_sq = self.decay * self.mean_sq + (1.0 - self.decay) * batch_ms
        return x * torch.rsqrt(self.mean_sq.float() + 1e-6)


class SensorClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(RunningRMS(CHANNELS) for _ in range(N_SENSORS))
        self.head = nn.Sequential(
            nn.Linear(N_SENSORS * CHANNELS, 64), nn.GELU(),
            nn.Linear(64, 64), nn.GELU(),
            nn.Linear(64, 1),
        )

    def forward(self, readings, target):
        feats = torch.cat([norm(readings[:, i]) for i, norm in enumerate(self.norms)], dim=1)
        logits = self.head(feats).squeeze(-1)
        p = torch.sigmoid(logits)
        # hand-written BCE "to see both terms": in bf16, p rounds to exactly 1.0 once a
        # logit passes ~6.24, and log1p(-1.0) is -inf
        loss = -(target * torch.log(p) + (1 - target) * torch.log1p(-p)).mean()
        return logits, loss


def make_batch(direction, gains, n=128):
    target = (torch.rand(n) < 0.5).float()
    signal = ((2 * target - 1)[:, None] * direction).view(n, N_SENSORS, CHANNELS)
    readings = (torch.randn(n, N_SENSORS, CHANNELS) + signal) * gains
    return readings, target


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    direction = torch.randn(N_SENSORS * CHANNELS)
    direction /= direction.norm()
    gains = 0.7 + 0.7 * torch.rand(N_SENSORS, CHANNELS)
    model = SensorClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(STEPS):
            readings, target = make_batch(direction, gains)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, loss = model(readings, target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0 or step == STEPS - 1:
                print(f"step {step} loss {loss.item():.4f} max|logit| {logits.float().abs().max().item():.1f}")

    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
