"""EXPECT: none
HEALTHY: twin of f2_fp16_running_rms_absorbed.py and f5_bf16_manual_bce_late_nan.py. A
binary classifier over 16 sensors (4 channels each) trained for 400 steps under bf16
autocast with AdamW and no GradScaler (correct for bf16). Each sensor has a slow running
mean-square normalizer (EMA decay 0.9999) whose statistics are kept in fp32, and the loss is
the stable binary_cross_entropy_with_logits on fp32 logits, computed inside the model's
forward. Nothing may fire: the only low-precision ops are the Linear/GELU layers under
autocast; there is no fp16/bf16 add and no fp16/bf16 reduction anywhere (the EMA adds and
the normalizer run in fp32), so nothing for AMP110/AMP111 to see. The logits reach 9.1 and
-8.9 (past the ~6.24 where the hand-written bf16 loss of the f5 twin turns NaN), but this
loss stays finite on all 400 steps (no AMP112/AMP103/AMP101); total grad norm 0.085..0.38
(< 100: no AMP104; > 1e-6, and every parameter's max |grad| >= 8.6e-5 > 1e-10: no AMP105).
bf16 needs no scaler (no AMP010) and there is none, so no loss-scale codes (AMP106-AMP109).
The running statistics move as they should (fp32, 1.0 -> 0.980..1.037 after 400 steps).
"""
import json

import torch
from torch import nn
from torch.nn import functional as F

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
        loss = F.binary_cross_entropy_with_logits(logits.float(), target)
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
