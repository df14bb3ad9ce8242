"""EXPECT: none

FAULT: none (healthy control). A multi-task tabular model (shared MLP trunk, a
classification head, a regression head and an auxiliary feature-reconstruction head)
trained under bf16 CPU autocast with no GradScaler (bf16 has fp32's exponent range and
needs no loss scaling). The total loss is a weighted sum of per-task losses computed
inside the region (fp32 on the CPU) with task weights {cls: 1.0, reg: 0.5, recon: 1e-3}:
the reconstruction head's gradients are ~1e-3 of the others' (unscaled, in fp32 .grad),
small but nowhere near vanishing (layer max far above 1e-10, total norm far above 1e-6),
and in bf16 they cannot underflow. The weighted sum is fp32, so no absorption in low
precision. AdamW + clip_grad_norm_ without a scaler, which is the bf16 recipe. 40 steps.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
N_FEAT, N_CLASSES = 48, 5
TASK_WEIGHTS = {"cls": 1.0, "reg": 0.5, "recon": 1e-3}


class MultiTaskNet(nn.Module):
    def __init__(self, width=128):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(N_FEAT, width), nn.SiLU(), nn.LayerNorm(width),
            nn.Linear(width, width), nn.SiLU(), nn.LayerNorm(width),
        )
        self.heads = nn.ModuleDict({
            "cls": nn.Linear(width, N_CLASSES),
            "reg": nn.Sequential(nn.Linear(width, 32), nn.SiLU(), nn.Linear(32, 1)),
            "recon": nn.Linear(width, N_FEAT),
        })

    def forward(self, x):
        h = self.trunk(x)
        return {name: head(h) for name, head in self.heads.items()}


def compute_losses(out, batch):
    return {
        "cls": F.cross_entropy(out["cls"], batch["label"]),
        "reg": F.smooth_l1_loss(out["reg"].squeeze(-1), batch["target"]),
        "recon": F.mse_loss(out["recon"], batch["x"]),
    }


def make_batch(g, n=64):
    x = torch.randn(n, N_FEAT, generator=g)
    w = torch.linspace(-1, 1, N_FEAT)
    label = ((x[:, :N_CLASSES] * 2).argmax(-1) + (x @ w > 0).long()) % N_CLASSES
    target = (x @ w) * 0.3 + 0.1 * torch.randn(n, generator=g)
    return {"x": x, "label": label, "target": target}


def train():
    g = torch.Generator().manual_seed(1)
    model = MultiTaskNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model.train()
    for step in range(40):
        batch = make_batch(g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch["x"])
            losses = compute_losses(out, batch)
            loss = sum(TASK_WEIGHTS[k] * v for k, v in losses.items())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if DEBUG:
            recon_max = model.heads["recon"].weight.grad.abs().max().item()
            print(f"step {step} loss {loss.item():.4f} " + " ".join(f"{k}={v.item():.3f}" for k, v in losses.items())
                  + f" norm {norm.item():.3f} recon_grad_max {recon_max:.2e}", file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
