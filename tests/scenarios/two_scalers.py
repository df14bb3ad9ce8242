"""EXPECT: AMP101,AMP112
MAY: AMP102
FAULT: two models trained in one loop, each with its own Adam and its own
`GradScaler("cpu", init_scale=4096)`, both in fp16 autocast: `price_net` (an MLP regressor,
MSE) and `count_net` (a Poisson count model whose forward returns
`torch.exp(log_rate)`, computed in fp16, fed to `F.poisson_nll_loss(log_input=False)`).
At iteration 12 one record of count_net's batch arrives unscaled (x100): its log-rate
becomes ~24 (finite in fp16), `exp` overflows to inf, count_net's loss is NaN and its
scaler skips that step (4096 -> 2048). price_net is untouched: its loss, gradients and
scale stay healthy throughout, and no step of either scaler is skipped at any other
iteration (checked with plain torch, `--plain`).

Why these codes (pages):
- AMP101 "first op whose output holds NaN or Inf while all of its inputs were finite":
  exp in count_net's forward (module CountNet / count_net, the `return torch.exp(...)`
  line), replayed at the skipped step (trace="auto").
- AMP112 "the loss is NaN/Inf when backward starts": count_net's backward line.
- Step: DESIGN/index.md "Several optimizers or several GradScalers ... count one step per
  iteration, ending after the last of them (learned in the first iteration, which may
  count twice)" -> step 12 (13 tolerated).
Must NOT fire: anything naming price_net, its lines or its scaler; AMP103 (the scaler
skipped it); AMP108 (one halving, 2048 > 4096/100 and > 128), AMP107, AMP109; AMP104
(healthy norms; the skipped step's norm is NaN).
MAY: AMP102 - the per-op checks of the replay see exp's output, whose max is inf; the page
does not say whether an inf output also counts as "|x| > 60000".
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)

STEPS = 40
FAULT_STEP = 12


def make_data():
    gen = torch.Generator().manual_seed(3)
    w_price = torch.randn(10, 1, generator=gen)
    w_count = torch.randn(6, 1, generator=gen) * 0.4
    data = []
    for step in range(STEPS):
        xa = torch.randn(48, 10, generator=gen)
        ya = torch.sin(xa @ w_price) + 0.05 * torch.randn(48, 1, generator=gen)
        xb = torch.randn(48, 6, generator=gen)
        if step == FAULT_STEP:
            i = (xb @ w_count).argmax()
            xb[i] = xb[i] * 100.0                  # one record arrives unscaled
        yb = torch.poisson(torch.exp(0.5 + (xb @ w_count).clamp(max=3)), generator=gen)
        data.append((xa, ya, xb, yb))
    return data


class CountNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.log_rate = nn.Linear(32, 1)
        self.skip = nn.Linear(6, 1)

    def forward(self, x):
        return torch.exp(self.log_rate(self.body(x)) + self.skip(x))  # <-- L:exp


def build():
    torch.manual_seed(0)
    price_net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    count_net = CountNet()
    return price_net, count_net


def train(data, diag=None):
    price_net, count_net = build()
    opt_p = torch.optim.Adam(price_net.parameters(), lr=3e-3)
    opt_c = torch.optim.Adam(count_net.parameters(), lr=3e-3)
    scaler_p = torch.amp.GradScaler("cpu", init_scale=4096.0)
    scaler_c = torch.amp.GradScaler("cpu", init_scale=4096.0)
    hist = []
    for xa, ya, xb, yb in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss_p = F.mse_loss(price_net(xa).float(), ya)
        opt_p.zero_grad(set_to_none=True)
        scaler_p.scale(loss_p).backward()  # <-- L:backward_p
        scaler_p.step(opt_p)
        scaler_p.update()  # <-- L:update_p

        with torch.autocast("cpu", dtype=torch.float16):
            rate = count_net(xb)  # <-- L:call_c
            loss_c = F.poisson_nll_loss(rate.float(), yb, log_input=False)
        opt_c.zero_grad(set_to_none=True)
        scaler_c.scale(loss_c).backward()  # <-- L:backward_c
        scaler_c.step(opt_c)
        scaler_c.update()  # <-- L:update_c
        hist.append((loss_p.item(), scaler_p.get_scale(), loss_c.item(), scaler_c.get_scale()))
        if diag is not None:
            diag.append(rate.abs().max().item())
    return (price_net, count_net), hist


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
    ref_models, ref_hist = train(data, diag)
    for step, ((lp, sp, lc, sc), rmax) in enumerate(zip(ref_hist, diag)):
        print(f"plain step {step:2d} price loss={lp:.4g} scale={sp:g} | count loss={lc:.4g} scale={sc:g} rate_max={rmax:.4g}")
    if "--plain" in sys.argv:
        return
    with amp_runtime.guard(policy="record") as g:
        models, hist = train(data)
    flat = lambda h: [v for row in h for v in row]
    print("LOSSES_MATCH", same_list(flat(ref_hist), flat(hist)))
    ok = all(same(a, b) for rm, m in zip(ref_models, models)
             for a, b in zip(rm.state_dict().values(), m.state_dict().values()))
    print("WEIGHTS_MATCH", ok)
    print("LINES", marker_lines())
    for e in g.report.events:
        print(f"EVENT {e.code} step={e.step} module={e.module} op={e.op} source={e.source} | {e.message}")
    print(g.report.summary())
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
