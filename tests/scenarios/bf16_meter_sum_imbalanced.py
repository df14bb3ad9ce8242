"""EXPECT: AMP111
MAY: AMP004
FAULT: twin of h2_bf16_meter_sum_fp32_accum.py (same bf16-stored smart-meter readings,
model, seed, bf16 autocast, AdamW) whose model sum-pools each day's devices in bf16:
`day.sum(dim=1)` on a bf16 tensor returns bf16 and nothing upcasts it (CPU autocast keeps
sum in low precision, as docs/rules/AMP111.md's references note). Every one of these reductions (16 per step, one per day,
on every one of the 300 steps) runs over one heat pump reading of 1000..3000 Wh and 7..31
standby readings of 0.005..0.05 Wh: in every reduced slice (house, bin) the large value is
>= 19980x the largest small one, so the magnitudes differ by more than AMP111's 1e4 however
the spread is taken (smallest large / largest small >= 19980; max / min nonzero 6.0e5;
max / median 9.0e4..1.4e5; the large values are 3..12.5 % of each tensor). The bf16 result
keeps 8 significant bits: against an fp32 sum of the same bf16 values, the error reaches up
to 101 % of a slice's whole standby total (the standby energy is rounded away, or doubled).
With 16 candidate reductions on every watched step, the 1-in-16 sampling sees some.
AMP004 is only a MAY (low-precision-reduce: DESIGN.md says the runtime flags a reduction whose input
and output are both bf16; its page is outside what this test may read).
Nothing else: the loss stays finite and falls (no AMP101/103/112), grad norm 0.004..15.4,
every parameter's max |grad| >= 1.9e-5 (no AMP104/105), no bf16 add (no AMP110), no scaler.
"""
import json

import torch
from torch import nn
from torch.nn import functional as F

import amp_runtime

STEPS = 300
N_HOUSES, N_DAYS, N_BINS = 64, 16, 4
N_BATCHES = 50


def make_dataset():
    """bf16 readings: for each batch, a list of 16 day tensors (houses, devices, bins)."""
    batches = []
    for _ in range(N_BATCHES):
        days = []
        standby_level = torch.rand(N_HOUSES, 1, 1) * 0.045 + 0.005
        heat_level = torch.rand(N_HOUSES, 1, 1) * 2000.0 + 1000.0
        for _ in range(N_DAYS):
            n_dev = int(torch.randint(8, 33, ()))
            standby = standby_level * (0.5 + torch.rand(N_HOUSES, n_dev - 1, N_BINS))
            standby = standby.clamp(0.005, 0.05)
            heat = heat_level * (0.8 + 0.4 * torch.rand(N_HOUSES, 1, N_BINS))
            heat = heat.clamp(1000.0, 3000.0)
            days.append(torch.cat([heat, standby], dim=1).to(torch.bfloat16))
        # next month's consumption (kWh), from the exact fp32 totals
        total = sum(d.float().sum(dim=(1, 2)) for d in days)
        target = torch.log1p(total / 1000.0 * 30 / N_DAYS) + 0.05 * torch.randn(N_HOUSES)
        target = target - 7.5  # centred: log(1800 kWh) is a typical month
        batches.append((days, target))
    return batches


class MeterModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(N_DAYS * N_BINS, 128), nn.GELU(),
            nn.Linear(128, 64), nn.GELU(),
            nn.Linear(64, 1),
        )

    def forward(self, days):
        daily = torch.stack([day.sum(dim=1) for day in days], dim=1)  # bf16 in, bf16 out
        feats = (torch.log1p(daily.float()) - 9.0).flatten(1)  # log-Wh, centred
        return self.mlp(feats).squeeze(-1)


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = make_dataset()
    model = MeterModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(STEPS):
            days, target = data[step % N_BATCHES]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = model(days)
                loss = F.mse_loss(pred.float(), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0 or step == STEPS - 1:
                print(f"step {step} loss {loss.item():.4f}")

    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
