"""EXPECT: AMP104
MAY: AMP105

FAULT: a tabular classifier (MLP) trained with bf16 CPU autocast, AdamW and a hand-written
warm-restart schedule (linear warmup, cosine decay, then an SGDR-style restart). The
restart peak comes from the config entry `restart_lr: 2.0`, a units slip for 2e-3, so at
the restart (step 20, 0-based optimizer step) the learning rate jumps from ~1e-4 to 2.0
for one cosine cycle. Steps 0-19 are healthy (unscaled gradient norm ~1). The update of
step 20 moves every weight by ~2 (Adam's step is ~lr per weight), the activations and
logits blow up, and from step 21 on the total gradient norm is far above 1000 (AMP104,
P0; first at step 21, module: the whole model). Everything stays finite in bf16 (no
AMP101/AMP103/AMP112); no GradScaler, which is right for bf16. Units that the huge
update kills may leave a layer with (near-)zero gradients (AMP105 left open).
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
CFG = {"lr": 3e-3, "min_lr": 1e-4, "warmup": 4, "cycle": 16, "restart_lr": 2.0, "steps": 30, "wd": 0.01}
N_FEAT, N_CLASSES = 40, 8


def lr_at(step):
    if step < CFG["warmup"]:
        return CFG["lr"] * (step + 1) / CFG["warmup"]
    cycle, pos = divmod(step - CFG["warmup"], CFG["cycle"])
    peak = CFG["lr"] if cycle == 0 else CFG["restart_lr"]
    return CFG["min_lr"] + 0.5 * (peak - CFG["min_lr"]) * (1 + math.cos(math.pi * pos / CFG["cycle"]))


class TabularNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEAT, 256), nn.GELU(),
            nn.Linear(256, 256), nn.GELU(),
            nn.Linear(256, 128), nn.GELU(),
            nn.Linear(128, N_CLASSES),
        )

    def forward(self, x):
        return self.net(x)


def make_batch(g, n=128):
    x = torch.randn(n, N_FEAT, generator=g)
    score = x[:, :N_CLASSES] + 0.5 * x[:, N_CLASSES:2 * N_CLASSES]
    y = score.argmax(-1)
    return x, y


def train():
    g = torch.Generator().manual_seed(1)
    model = TabularNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG["lr"], weight_decay=CFG["wd"])
    for step in range(CFG["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        x, y = make_batch(g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if DEBUG:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            lmax = min(p.grad.abs().max().item() for p in model.parameters())
        optimizer.step()
        if DEBUG:
            print(f"step {step} lr {lr_at(step):.2e} loss {loss.item():.4g} grad_norm {norm.item():.4g} "
                  f"min_layer_max {lmax:.2e}", file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
