"""EXPECT: AMP102
MAY: none
FAULT: a weather-station regressor folds its input standardisation into a frozen
`nn.Linear` (`model.standardize`: weight = diag(1/std), bias = -mean/std, built from the
training-set statistics), so under fp16 autocast the standardised features are an fp16
GEMM output. From step 9 on (one row in every batch from step 9 to step 11) a station
reports missing humidity with the sentinel -9999 instead of NaN; humidity has mean 0.5
and std 0.16, so the standardised value is about -62500: above AMP102's 60000, yet below
fp16's 65504, so nothing overflows. The model soft-clips the standardised features in
fp32 (`4 * tanh(z / 4)`), so the rest of the forward, the loss and the gradients stay
finite and small (the tanh is saturated, its gradient is 0 for that value). The guard
runs with trace="always" (AMP102 needs per-op checks). AMP102 is expected at step 9, op
`linear` (F.linear / nn.Linear), module `standardize`, source line
`z = self.standardize(x)` in `WeatherNet.forward`, with a magnitude of ~62500.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

FEATURES = ["temp_c", "pressure_hpa", "humidity", "wind_ms", "cloud", "dew_c"]
MEAN = torch.tensor([12.0, 1013.0, 0.5, 4.0, 0.45, 6.0])
STD = torch.tensor([8.0, 16.0, 0.16, 2.5, 0.3, 7.0])
MISSING = -9999.0


class WeatherNet(nn.Module):
    def __init__(self, mean, std, d_hidden=64, horizon=4):
        super().__init__()
        d = mean.numel()
        # standardisation folded into a linear layer (exported as one GEMM), frozen
        self.standardize = nn.Linear(d, d)
        with torch.no_grad():
            self.standardize.weight.copy_(torch.diag(1.0 / std))
            self.standardize.bias.copy_(-mean / std)
        self.standardize.requires_grad_(False)
        self.mlp = nn.Sequential(
            nn.Linear(d, d_hidden), nn.ReLU(),
            nn.Linear(d_hidden, d_hidden), nn.ReLU(),
            nn.Linear(d_hidden, horizon),
        )

    def forward(self, x):
        z = self.standardize(x)
        z = 4.0 * torch.tanh(z.float() / 4.0)    # soft-clip outliers, in fp32
        return self.mlp(z)


def station_batches(steps, batch_size=64, bad_steps=(9, 10, 11)):
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = MEAN + STD * torch.randn(batch_size, MEAN.numel(), generator=g)
        x[:, 2].clamp_(0.0, 1.0)
        # next-hours temperature depends on temperature, pressure trend and humidity
        y = torch.stack([x[:, 0] * (0.9 ** h) + 2.0 * (x[:, 2] - 0.5) for h in range(1, 5)], 1)
        if step in bad_steps:
            x[5, 2] = MISSING            # missing humidity, sentinel instead of NaN
        yield x, (y - 12.0) / 8.0


def main():
    model = WeatherNet(MEAN, STD)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record", trace="always", model=model) as g:
        for step, (x, y) in enumerate(station_batches(24)):
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
                loss = F.smooth_l1_loss(pred.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, max_norm=5.0)
            scaler.step(optimizer)
            scaler.update()
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
