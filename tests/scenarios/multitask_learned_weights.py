"""EXPECT: AMP006 AMP101 AMP103 AMP105 AMP108 AMP112
MAY: AMP104

FAULT: a multi-task model whose forward returns a dict of three losses, summed by
UncertaintyWeighting (Kendall et al.: sum exp(-s_i) L_i + s_i, learned log-variances s). The
model steps every iteration through the GradScaler (unscale_, clip, scaler.step, update);
the task weights have their own SGD(lr=1e-2) that steps every 4th iteration on the
gradient accumulated over 4 iterations, with a plain `weight_opt.step()` after
scaler.update(): its gradients come out of the scaled backward and are never unscaled.
- AMP006: an optimizer steps on gradients a scaled backward wrote (every 4th step).
- AMP112: the first weight update (step 3, applied norm 4.1e5 = 65536 x the true one) moves
  the log-variances to [3233, -1992, 1656]; at step 4 exp(1992) is inf and the total loss
  is inf from then on, every step.
- AMP101: that exp runs inside UncertaintyWeighting (a root module) on finite inputs; the
  model's step is skipped, so the replay runs and names it.
- AMP103: the weight optimizer steps at step 7 on the accumulated non-finite gradient (no
  scaler sees that optimizer); s_reg becomes inf.
- AMP105: from step 8 every task weight exp(-s) is exactly 0, and the backward writes exact
  zeros into every layer of the model (total norm 0.0, every layer's max 0) at all
  applied steps but 20-23.
- AMP108: skips at 4-7 and 20-23 (s_rec = -64 at step 19) halve the scale 65536 -> 256,
  below 1/100 of the initial scale.
MAY: AMP104 (the weight optimizer's raw, scaled gradient norms are 4.1e5, 2.8e4 and 1773,
and at step 23 its finite gradient (7.9e31) has an fp32 norm of inf; divided by the scale
only that one exceeds 1000; the model's own norms are clipped to 1).
Must stay silent: AMP107 (the scale stops at 256), AMP109 (90 steps).
"""
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

IN_DIM, HIDDEN, N_CLASSES, BATCH = 48, 384, 10, 256
STEPS, WARMUP, BASE_LR = 90, 10, 2e-3
WEIGHT_EVERY, WEIGHT_LR = 4, 1e-2           # the task weights are updated every 4 steps
LOG_EVERY = 10
TASKS = ("cls", "reg", "rec")


class MultiTaskNet(nn.Module):
    """Shared trunk, three heads; forward returns a dict of per-task losses."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.cls_head = nn.Linear(HIDDEN, N_CLASSES)
        self.reg_head = nn.Linear(HIDDEN, 1)
        self.rec_head = nn.Linear(HIDDEN, IN_DIM)

    def forward(self, x, labels, value):
        h = self.trunk(x)
        return {
            "cls": F.cross_entropy(self.cls_head(h).float(), labels),
            "reg": F.smooth_l1_loss(self.reg_head(h).float().squeeze(-1), value),
            "rec": F.mse_loss(self.rec_head(h).float(), x),
        }


class UncertaintyWeighting(nn.Module):
    """Kendall et al. 2018: sum_i exp(-s_i) * L_i + s_i, with s_i = log sigma_i^2 learned."""

    def __init__(self, n_tasks):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(n_tasks))

    def forward(self, losses):
        stacked = torch.stack([losses[k] for k in TASKS])
        return (torch.exp(-self.log_vars) * stacked + self.log_vars).sum()


class TaskData:
    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.proto = torch.randn(N_CLASSES, IN_DIM, generator=g)
        self.w_val = torch.randn(IN_DIM, generator=g) / IN_DIM ** 0.5

    def batch(self):
        labels = torch.randint(0, N_CLASSES, (BATCH,), generator=self.g)
        x = self.proto[labels] + 0.8 * torch.randn(BATCH, IN_DIM, generator=self.g)
        value = torch.tanh(x @ self.w_val) + 0.05 * torch.randn(BATCH, generator=self.g)
        return x, labels, value


def lr_lambda(step):
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def main():
    model = MultiTaskNet()
    weighting = UncertaintyWeighting(len(TASKS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    weight_opt = torch.optim.SGD(weighting.parameters(), lr=WEIGHT_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    scaler = torch.amp.GradScaler("cpu")
    data = TaskData()
    t0 = time.time()
    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(STEPS):
            x, labels, value = data.batch()
            with torch.autocast("cpu", dtype=torch.float16):
                losses = model(x, labels, value)
                total = weighting(losses)
            scaler.scale(total).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % WEIGHT_EVERY == WEIGHT_EVERY - 1:
                # the task weights learn from the gradient accumulated over the last 4 steps
                weight_opt.step()
                weight_opt.zero_grad(set_to_none=True)
            if step % LOG_EVERY == 0 or not math.isfinite(total.item()):
                parts = " ".join(f"{k} {v.item():.3f}" for k, v in losses.items())
                s = " ".join(f"{v:.2f}" for v in weighting.log_vars.tolist())
                print(f"step {step:3d} total {total.item():.4f} {parts} log_vars [{s}] "
                      f"grad_norm {float(grad_norm):.3f} scale {scaler.get_scale():.4g}")
    print(f"done in {time.time() - t0:.1f}s, final scale {scaler.get_scale():.4g}")
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
