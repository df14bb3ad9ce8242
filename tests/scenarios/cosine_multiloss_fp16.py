"""EXPECT: none
MAY: AMP104

HEALTHY: a multi-task tabular model (item embedding + dense features -> SiLU trunk -> class head
and regression head) trained under fp16 CPU autocast with a GradScaler and AdamW (lr 1e-2) on a
cosine schedule, `CosineAnnealingLR(T_max=59, eta_min=0)`, stepped after every step: the learning
rate falls 1e-2 -> 4.5e-4 at step 50 -> exactly 0 at step 59, the last step, so the last updates
are tiny and the last one is zero. Three losses of very different scales are summed inside the
region with weights 1, 10 and 1e-3 (cross_entropy ~1.3, 10 x mse_loss ~5-14, 1e-3 x an fp32
embedding L2 of ~15); cross_entropy and mse_loss run in fp32 under CPU autocast, the L2 term is
computed from `.float()`. Plain torch, no guard: the scaler skips steps 0, 2 and 6 while it
settles (65536 -> 8192: the scaled fp16 backward of the 10 x mse term overflows at 65536 and
32768), then no skip; unscaled total grad norm 7-15 on the applied steps, smallest
per-parameter max |grad| 0.02; losses cls 1.37 -> 1.09, reg 1.41 -> 0.7-0.8.

Why no event from the pages: AMP108 says "A few decreases while the scale settles at the start
of training are normal" and its conditions are not met (3 non-consecutive decreases, 8192 is
neither below 65536/100 nor below 128); AMP109's window "must be full first, counted from the
first step the scaler did not skip" (100 steps, the run has 60); skipped steps are not AMP103.
A learning rate of 0 is not a gradient property (AMP105 looks at gradients, which stay ~0.02
and up); updates absorbed into fp32 master weights are not "fp16/bf16 additions" (AMP110). The
summed losses are fp32 scalars. MAY AMP104: the page computes the norm "once per training step,
unscaled" and reports one above 100; on the three skipped steps the gradients hold inf (the
unscaled norm is inf), and the page does not say whether a step the scaler skipped is judged
(AMP103's page excludes such steps explicitly, AMP104's says nothing).
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

N_ITEMS, D_EMB, D_DENSE, N_CLASSES = 200, 16, 12, 4
W_CLS = torch.randn(D_EMB + D_DENSE, N_CLASSES)
W_REG = torch.randn(D_EMB + D_DENSE, 1) / 5
ITEM_FEATS = torch.randn(N_ITEMS, D_EMB)


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.item_emb = nn.Embedding(N_ITEMS, D_EMB)
        self.trunk = nn.Sequential(nn.Linear(D_EMB + D_DENSE, 96), nn.SiLU(), nn.Linear(96, 96), nn.SiLU())
        self.cls_head = nn.Linear(96, N_CLASSES)
        self.reg_head = nn.Linear(96, 1)

    def forward(self, items, dense):
        h = self.trunk(torch.cat([self.item_emb(items), dense], dim=-1))
        return self.cls_head(h), self.reg_head(h).squeeze(-1)


def batch(gen, n=64):
    items = torch.randint(0, N_ITEMS, (n,), generator=gen)
    dense = torch.randn(n, D_DENSE, generator=gen)
    z = torch.cat([ITEM_FEATS[items], dense], dim=-1)
    y_cls = (z @ W_CLS).argmax(-1)
    y_reg = (z @ W_REG).squeeze(-1) + 0.1 * torch.randn(n, generator=gen)  # standardised target
    return items, dense, y_cls, y_reg


STEPS = 60
LOSS_WEIGHTS = {"cls": 1.0, "reg": 10.0, "emb_l2": 1e-3}
model = MultiTaskNet()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS - 1, eta_min=0.0)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(1)

with amp_runtime.guard(policy="record") as g:
    for step in range(STEPS):
        items, dense, y_cls, y_reg = batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits, pred = model(items, dense)
            losses = {
                "cls": F.cross_entropy(logits, y_cls),
                "reg": F.mse_loss(pred, y_reg),
                "emb_l2": model.item_emb(items).float().pow(2).sum(-1).mean(),
            }
            loss = sum(LOSS_WEIGHTS[k] * v for k, v in losses.items())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % 10 == 0 or step >= STEPS - 2:
            print(f"step {step} loss {loss.item():.4f} "
                  + " ".join(f"{k} {v.item():.4f}" for k, v in losses.items())
                  + f" lr {optimizer.param_groups[0]['lr']:.3g} scale {scaler.get_scale():.4g}")

for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
