"""EXPECT: AMP101
MAY: AMP102,AMP105
FAULT: a heteroscedastic house-price regressor returns a tuple `(mean, variance)` with
`variance = self.log_var(h).exp()` computed in fp16 under autocast. The variance head's
bias is initialised to log(price variance in $k^2) = log(~1.6e5) ~ 12.0, so that the
reported uncertainty starts at the data's spread; exp(12) ~ 1.6e5 > 65504, so the second
output is inf in fp16 on every row from step 0 on. The script is in the usual "MSE
warm-up" phase of heteroscedastic training: the loss is MSE on the (standardised) mean
only and the variance output is discarded (`mean, _ = model(x)`), so the inf never reaches
the loss, the gradients or the scaler (plain torch: all losses finite, no skipped step,
the variance output inf on every step).

Must it be reported? AMP101's page: "Reports the first op whose output holds NaN or Inf
while all of its inputs were finite" - nothing about whether the output is used. So under
`trace="always"` ("every op is checked from the start") the exp must be AMP101 (op exp,
module = the root model HeteroRegressor, the `return self.mean(h), ...exp()` line, step 0,
then counted on every step). Under the default `trace="auto"` the guard "runs cheap
step-level checks until something goes non-finite (the loss at backward, the gradients, a
GradScaler skipping the step)" - none of those happens, so the auto run must record
NOTHING (printed as AUTO_EVENTS, expected []). The EVENTS line is the trace="always" run.
Must NOT fire (either run): AMP112, AMP103, AMP107/108/109, AMP104, AMP004 (no fp16
reduction), AMP010.
MAY: AMP102 - rows whose log-variance lands in [11.0, 11.09] give exp outputs in
(6e4, 65504]. AMP105 - the variance head gets no gradient at all (its .grad stays None
during the warm-up phase); the page lists "a detached branch" as a cause and "a layer whose
gradients are all exactly zero", but does not say whether a parameter without any gradient
counts.
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 30


def make_data():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(6, 1, generator=gen)
    rows = []
    for _ in range(STEPS):
        x = torch.randn(64, 6, generator=gen)
        price_k = 400 + 600 * torch.tanh(x @ w / 2) + 40 * torch.randn(64, 1, generator=gen)
        rows.append((x, price_k))
    all_prices = torch.cat([p for _, p in rows])
    mu, sd = all_prices.mean(), all_prices.std()
    return [(x, (p - mu) / sd) for x, p in rows], sd.item() ** 2


class HeteroRegressor(nn.Module):
    def __init__(self, price_var):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.mean = nn.Linear(64, 1)
        self.log_var = nn.Linear(64, 1)
        nn.init.constant_(self.log_var.bias, math.log(price_var))   # start at the data's spread

    def forward(self, x):
        h = self.body(x)
        return self.mean(h), self.log_var(h).exp()  # <-- L:exp


def train(data, price_var, diag=None):
    torch.manual_seed(0)
    model = HeteroRegressor(price_var)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    losses, scales = [], []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            mean, _ = model(x)  # <-- L:call
            loss = F.mse_loss(mean.float(), y)      # warm-up phase: MSE on the mean only
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
        if diag is not None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                lv = model.log_var(model.body(x))
                var = lv.exp()
            diag.append((lv.min().item(), lv.max().item(), int((~var.isfinite()).sum()),
                         int(((var.abs() > 6e4) & var.isfinite()).sum()), model.log_var.weight.grad is None))
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


def guarded(data, price_var, ref, trace):
    ref_model, ref_losses, ref_scales = ref
    with amp_runtime.guard(policy="record", trace=trace) as g:
        model, losses, scales = train(data, price_var)
    tag = trace.upper()
    print(f"{tag} LOSSES_MATCH", same_list(ref_losses, losses) and same_list(ref_scales, scales))
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    print(f"{tag} WEIGHTS_MATCH", all(same(ref_sd[k], sd[k]) for k in ref_sd))
    for e in g.report.events:
        print(f"{tag} EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} | {e.message}")
    print(g.report.summary())
    return (all(same(ref_sd[k], sd[k]) for k in ref_sd) and same_list(ref_losses, losses)), sorted({e.code for e in g.report.events})


def main():
    data, price_var = make_data()
    diag = []
    ref = train(data, price_var, diag)
    print("price variance ($k^2):", round(price_var), " log:", round(math.log(price_var), 3))
    for step, (lvmin, lvmax, n_inf, n_near, no_grad) in enumerate(diag):
        print(f"plain step {step:2d}: loss={ref[1][step]:.4g} scale={ref[2][step]:g} log_var in [{lvmin:.3f}, {lvmax:.3f}] "
              f"inf rows={n_inf}/64 finite>6e4 rows={n_near} log_var.grad is None: {no_grad}")
    if "--plain" in sys.argv:
        return
    ok_auto, auto_codes = guarded(data, price_var, ref, "auto")
    ok_always, always_codes = guarded(data, price_var, ref, "always")
    print("LOSSES_MATCH", ok_auto and ok_always)
    print("WEIGHTS_MATCH", ok_auto and ok_always)
    print("LINES", marker_lines())
    print("AUTO_EVENTS " + json.dumps(auto_codes))
    print("EVENTS " + json.dumps(always_codes))


if __name__ == "__main__":
    main()
