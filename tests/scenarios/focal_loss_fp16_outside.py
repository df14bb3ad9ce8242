"""EXPECT: AMP004,AMP101,AMP107,AMP108,AMP112
MAY: AMP002,AMP111

FAULT: a RetinaNet-style dense classification head, pretrained in fp32 on a source dataset
(line 92, stands in for loading that checkpoint: its logits reach about +-20), is fine-tuned
under fp16 autocast with a GradScaler on a target dataset that numbers the same classes
differently (line 93), so some anchors the head is sure of (logit > 8.33) are now negatives.
The hand-written `sigmoid_focal_loss` (lines 61-67) is called after the autocast block
(line 103) on the fp16 logits and casts the targets to fp16 too (`targets.type_as(logits)`):
in fp16 `sigmoid(x)` rounds to exactly 1.0 for x > 8.33, `p_t = 1 - p` is 0 and
`torch.log(p_t)` at line 66 is -inf, so the loss is inf at every step (1-3 such anchors per
batch; plain torch, no guard: the same batches give a finite focal loss of 3.6-4.6 when the head
runs in fp32). GradScaler skips all 20 steps: its scale falls 65536 -> 1 at step 15 -> 2^-4.
The two `.sum()` calls at line 67 reduce fp16 tensors to fp16.

Pages: AMP112: "the loss is NaN/Inf when backward starts" (line 105, every step). AMP101: the
first op with a non-finite output from finite inputs is `log` at line 66, outside any module;
the replay of step 0 re-runs only root module calls ("a loss computed by functions outside any
module ... not replayed"), so it finds the head finite ("A replay that finds no non-finite op in
the model (its origin is null) points at the loss"), and AMP101 comes from the live per-op
checks the anomaly switches on, at step 1 ("switches per-op checks on for the next
occurrences"). AMP004: "a reduction's input and output are both fp16/bf16" (`loss.sum()` and
`targets.sum()`, line 67, on watched steps). AMP108 (5 consecutive decreases at step 4, below
1/100 of the initial scale at step 6) and AMP107 ("at or below 1 and not rising", step 15).
MAY AMP002: the runtime sentence is "a loss function runs with autocast off on low-precision
inputs produced under autocast", and this loss is the user's own function made of
sigmoid/mul/log/sum; the pages do not say whether the runtime recognises such a function as a
loss. MAY AMP111: `loss.sum()` in fp16 over terms spanning far more than 1e4 in magnitude (plus
inf), sampled one call in 16 once per-op checks are on. Not expected: AMP103 (the scaler skips
the steps), AMP011 (no epsilon), AMP104/AMP105 (no step is applied).
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.set_num_threads(1)
torch.manual_seed(0)

N_ANCHORS, N_CLASSES, D_FEAT = 64, 3, 32


class DenseHead(nn.Module):
    """RetinaNet-style classification subnet applied to per-anchor features."""

    def __init__(self, prior=0.01):
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(D_FEAT, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.cls = nn.Linear(64, N_CLASSES)
        nn.init.normal_(self.cls.weight, std=0.01)
        nn.init.constant_(self.cls.bias, -math.log((1 - prior) / prior))  # prior-probability init

    def forward(self, feats):
        return self.cls(self.tower(feats))


def sigmoid_focal_loss(logits, targets, alpha=0.25, gamma=2.0):
    targets = targets.type_as(logits)
    p = torch.sigmoid(logits)
    p_t = p * targets + (1 - p) * (1 - targets)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    loss = -alpha_t * (1 - p_t) ** gamma * torch.log(p_t)
    return loss.sum() / targets.sum().clamp(min=1.0)


PROJ = torch.randn(D_FEAT, N_CLASSES) / math.sqrt(D_FEAT)


def batch(gen, n=8, class_order=(0, 1, 2)):
    feats = torch.randn(n, N_ANCHORS, D_FEAT, generator=gen)
    targets = ((feats @ PROJ) > 2.05).float()  # ~2 % positive anchors
    return feats, targets[..., list(class_order)]


def pretrain_on_source(model, steps=120):
    """Stands in for loading the source-dataset checkpoint: fp32, BCE-with-logits."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        feats, targets = batch(gen)
        loss = F.binary_cross_entropy_with_logits(model(feats), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()


model = DenseHead()
pretrain_on_source(model)
TARGET_CLASSES = (1, 2, 0)  # the target dataset numbers the same three classes differently
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(3)

with amp_runtime.guard(policy="record") as g:
    for step in range(20):
        feats, targets = batch(gen, class_order=TARGET_CLASSES)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(feats)
        loss = sigmoid_focal_loss(logits, targets)  # INJECTED: fp16 loss after the block
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.4g}")

for e in g.report.events:
    print(f"EVENT {e.code} step={e.step} op={e.op} module={e.module!r} source={e.source} :: {e.message}")
print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
