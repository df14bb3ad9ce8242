"""EXPECT: AMP101,AMP107,AMP108,AMP112
MAY: AMP102,AMP104
FAULT: a weather regressor (4 raw sensor features, standardised with statistics
measured once at start-up) trains healthily in fp16 autocast with
`GradScaler("cpu", init_scale=64, growth_interval=5)`: no step is skipped for 40 steps
and the scale grows 64 -> 16384 (checked with plain torch). At step 40 of 60 the
pressure sensor's firmware switches from bar to Pa (x1e5); the standardised feature
becomes ~3.7e6, finite in fp32, and from then on every batch overflows fp16 in the
first Linear (`encoder.0`, its autocast input cast), the loss is NaN and GradScaler
skips every step: the scale halves 20 times, 16384 -> 2^-6.

Why these codes (pages):
- AMP101: "the first op whose output holds NaN or Inf while all of its inputs were
  finite"; with trace="auto" the guard "replays that step's forward with per-op checks,
  so AMP101 names the op of the step where it happened" -> linear in encoder.0, step 40,
  source = the `self.encoder(x)` line.
- AMP112: "Checks the tensor that backward() starts from and reports when it is NaN or
  Inf" -> step 40 (and every later step, counted).
- AMP108: "5 consecutive decreases once a step has gone through" (40 steps went through
  before) and "a scale below 128 that is still falling" -> around step 44.
- AMP107: "reports when it is at or below 1 and not rising" -> the scale reaches 1.0
  at the update of step 53.
MAY: AMP102 once per-op checks are on after the anomaly (some units of encoder.0 may
land in (60000, 65504]); AMP104 because its page does not say whether the inf/NaN norm
of a skipped step counts as "exceeds 1000".
Must NOT fire: AMP103 ("Steps that a GradScaler skips ... are not AMP103"), AMP109 (60
steps never fill its 100-step window), AMP106 (no gradient comes near 2^-24 at these
scales, checked), any code-pattern code (the loop is the documented recipe), and nothing
before step 40.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 60
FAULT_STEP = 40


def raw_batch(gen, bs=32):
    temp = 15 + 10 * torch.rand(bs, 1, generator=gen)         # deg C
    press = 0.95 + 0.1 * torch.rand(bs, 1, generator=gen)     # bar
    hum = 30 + 40 * torch.rand(bs, 1, generator=gen)          # %
    wind = 10 * torch.rand(bs, 1, generator=gen)              # m/s
    x = torch.cat([temp, press, hum, wind], 1)
    y = 0.5 * torch.sin(temp / 5) - 20 * (press - 1.0) + 0.01 * hum - 0.03 * wind
    return x, y


def make_data():
    gen = torch.Generator().manual_seed(1)
    calib, _ = raw_batch(gen, 256)
    mu, sd = calib.mean(0), calib.std(0)          # measured once, at start-up
    data = []
    for step in range(STEPS):
        x, y = raw_batch(gen)
        if step >= FAULT_STEP:
            x[:, 1] = x[:, 1] * 1e5               # firmware update: pressure now in Pa
        data.append(((x - mu) / sd, y))
    return data


class WeatherNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU())
        self.head = nn.Linear(48, 1)

    def forward(self, x):
        h = self.encoder(x)  # <-- L:encoder
        return self.head(h)


def train(data):
    torch.manual_seed(0)
    model = WeatherNet()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6, growth_interval=5)
    losses, scales = [], []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
            loss = F.mse_loss(pred.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # <-- L:backward
        scaler.step(opt)
        scaler.update()  # <-- L:update
        losses.append(loss.item())
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


def print_events(g):
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} | {e.message}")
    print(g.report.summary())


def main():
    data = make_data()
    ref_model, ref_losses, ref_scales = train(data)
    skipped_before = [i for i in range(1, FAULT_STEP) if ref_scales[i] < ref_scales[i - 1]]
    print("plain torch: scale", ref_scales[0], "->", ref_scales[FAULT_STEP - 1], "before the fault; skips before", skipped_before)
    print("plain torch: scale after step 53:", ref_scales[53], " final:", ref_scales[-1])
    with amp_runtime.guard(policy="record") as g:
        model, losses, scales = train(data)
    print("LOSSES_MATCH", same_list(ref_losses, losses) and same_list(ref_scales, scales))
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    print("WEIGHTS_MATCH", all(same(ref_sd[k], sd[k]) for k in ref_sd))
    print("WANT AMP101 step=40 module~encoder.0 op~linear line", marker_lines()["encoder"])
    print("WANT AMP112 step=40 line", marker_lines()["backward"], "; AMP107 ~step 53, AMP108 ~step 44 line", marker_lines()["update"])
    print_events(g)
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
