"""EXPECT: AMP104,AMP107,AMP108
MAY: AMP105,AMP110
FAULT: a wide-and-deep regressor (a linear "wide" layer on raw Poisson counts, ~8 per
feature, plus an MLP "deep" part on standardised features) trains in fp16 autocast with
`GradScaler("cpu", init_scale=1024)` and SGD(momentum=0.9). The warm-up schedule lost its
cap: `lr = PEAK_LR * (step + 1) / WARMUP_STEPS` with no `min(1.0, ...)`, so the learning
rate keeps rising (2e-4 at step 0, 1.2e-2 at step 59). The run is healthy for ~33 steps
(total grad norm < 100, no skipped step); then the wide layer passes SGD's stability
limit along the raw-count direction and its weights grow ~x3 per two steps
(0.07 -> ~700). The loss stays finite (fp32 loss from an fp16 prediction that stays below
~3.6e4), the forward never overflows, but `wide.weight`'s gradient overflows fp16 (only
that layer: the deep layers' gradients stay finite). GradScaler skips every other step,
the scale falls 1024 -> 0.25, and the steps that do go through carry total unscaled norms
of 1e2 .. 1.8e5. All of this is checked with plain torch below (`--plain`).

Why these codes (pages):
- AMP104: "total grad norm > 100 (P1), > 1000 (P0) - unscaled" on the steps that go
  through (steps 37-58, up to 1.8e5).
- AMP108: "a scale below 1/100 of its initial value, or a scale below 128 that is still
  falling" (64 at step 46, 8 at step 51).
- AMP107: "at or below 1 and not rising" (1.0 after step 56, 0.5 after 57).
Must NOT fire: AMP112 and AMP101 (the loss and the forward stay finite; AMP112 "Checks
the tensor that backward() starts from"), AMP103 (every non-finite step is skipped by the
scaler), AMP102 (no fp16 forward output above 6e4), AMP109 (60 < 100-step window),
AMP106 (checked at steps 0/32 at scale 1024: gradients far above 2^-24/1024), and no
event before step ~34.
MAY: AMP105 - at step 59 (a skipped step) the ReLU MLP has died and its layers' gradients
are all exactly zero; the page does not say whether skipped steps are judged. AMP110 -
the `wide + deep` add meets operands ~400x apart late in the run; below 2048 by the max
magnitudes, but the page does not say how "magnitude" is measured.
Events should name step >= 34 and the `scaler.update()` line for AMP107/AMP108, the
optimizer/scaler step for AMP104; any layer named should be `wide`.
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 60
PEAK_LR = 2e-3
WARMUP_STEPS = 10


def lr_at(step):
    # intended: PEAK_LR * min(1.0, (step + 1) / WARMUP_STEPS)
    return PEAK_LR * (step + 1) / WARMUP_STEPS


def make_data():
    gen = torch.Generator().manual_seed(2)
    w_dense = torch.randn(8, 1, generator=gen)
    data = []
    for _ in range(STEPS):
        counts = torch.poisson(torch.full((64, 4), 8.0), generator=gen)   # raw counts
        dense = torch.randn(64, 8, generator=gen)                          # standardised
        y = 0.05 * (counts.sum(1, keepdim=True) - 32) + torch.tanh(dense @ w_dense / 2)
        y = y + 0.1 * torch.randn(64, 1, generator=gen)
        data.append((counts, dense, y))
    return data


class WideDeep(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(4, 1)
        self.deep = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        nn.init.normal_(self.wide.weight, std=0.01)
        nn.init.zeros_(self.wide.bias)

    def forward(self, counts, dense):
        return self.wide(counts) + self.deep(dense)  # <-- L:forward


def train(data, diag=None):
    torch.manual_seed(0)
    model = WideDeep()
    opt = torch.optim.SGD(model.parameters(), lr=lr_at(0), momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    losses, scales = [], []
    for step, (counts, dense, y) in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(counts, dense)
            loss = F.mse_loss(pred.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # <-- L:backward
        if diag is not None:
            s = scaler.get_scale()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            norm = torch.norm(torch.stack([g.float().norm() for g in grads.values()])).item() / s
            nonfinite = sorted({n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("deep") else "")
                                for n, g in grads.items() if not torch.isfinite(g).all()})
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                fmax = max(model.wide(counts).abs().max().item(), model.deep(dense).abs().max().item(),
                           model(counts, dense).abs().max().item())
            zero_layers = [n for n, g in grads.items() if g.abs().max().item() == 0]
            diag.append((step, loss.item(), s, norm, nonfinite, fmax, zero_layers))
        scaler.step(opt)  # <-- L:step
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


def main():
    data = make_data()
    diag = []
    ref_model, ref_losses, ref_scales = train(data, diag)
    for step, loss, s, norm, nonfinite, fmax, zero_layers in diag:
        print(f"plain step {step:2d} lr={lr_at(step):.4f} loss={loss:.4g} scale={s:g} unscaled_norm={norm:.4g} "
              f"nonfinite_grads={nonfinite} fwd_max={fmax:.4g} zero_grad_layers={zero_layers}")
    print("plain: all losses finite:", all(math.isfinite(v) for v in ref_losses), " scales:", ref_scales)
    if "--plain" in sys.argv:
        return
    # Same run again, but with the diagnostics off (they run extra forwards).
    ref_model, ref_losses, ref_scales = train(data)
    with amp_runtime.guard(policy="record") as g:
        model, losses, scales = train(data)
    print("LOSSES_MATCH", same_list(ref_losses, losses) and same_list(ref_scales, scales))
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    print("WEIGHTS_MATCH", all(same(ref_sd[k], sd[k]) for k in ref_sd))
    print("LINES", marker_lines())
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} | {e.message}")
    print(g.report.summary())
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
