"""EXPECT: AMP109
MAY: none
FAULT: the GradScaler is built with growth_interval=3 ("recover fast after an overflow",
copied from a fine-tuning recipe) instead of the default 2000. The data and the model are
healthy; the scale doubles every 3 good steps until the scaled fp16 gradients of the
weight GEMMs in the backward overflow 65504, the scaler skips that step and halves the
scale, and the cycle repeats: the first skip is at step 12, then about one step in four or
five is skipped (52 of 240 steps) for the whole run. Step 0 is not skipped, so the
overflow window (100 steps, counted from the first step the scaler did not skip) is full
at step ~100, and AMP109 is due at the first skipped step after it (step 99 or 103 of 240
by how the window is counted; skips are at ..., 95, 99, 103, 107, ...; 21-24 per 100
steps), pointing at the `scaler.update()` line in `train()` (module: none / the whole
model). The loss stays finite (no AMP112), the scale never collapses or keeps falling (it
stays between 2^19 and 2^22 after warm-up, at most 2 decreases in a row, never below its
initial 2^16: no AMP107/AMP108), and every overflowing step is caught by the scaler (no
AMP103).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)


class Regressor(nn.Module):
    """A small multi-target regressor: 32 sensor features -> 8 targets."""

    def __init__(self, d_in=32, d_hidden=128, d_out=8):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.ReLU(),
            nn.Linear(d_hidden, d_hidden), nn.ReLU(),
        )
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(self.body(x))


def make_data(n=4096, d_in=32, d_out=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in ** 0.5
    y = torch.tanh(x @ w) * 3.0 + 0.1 * torch.randn(n, d_out, generator=g)
    return x, y


def batches(x, y, batch_size, steps):
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch_size,), generator=g)
        yield x[idx], y[idx]


def train(model, optimizer, scaler, loader, scale_log):
    for xb, yb in loader:
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(xb)
            loss = F.mse_loss(pred.float(), yb)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        scale_log.append(scaler.get_scale())


def main():
    x, y = make_data()
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    # "recover fast after an overflow": the scale doubles after only 3 good steps
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    scale_log = []
    with amp_runtime.guard(policy="record", model=model) as g:
        train(model, optimizer, scaler, batches(x, y, 256, 240), scale_log)
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
