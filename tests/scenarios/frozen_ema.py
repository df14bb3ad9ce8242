"""EXPECT: none

FAULT: none (healthy control). Transfer learning in the timm/fine-tuning style: a small
conv backbone whose stem and first stage are frozen with `requires_grad_(False)` (their
`.grad` stays None all run), a trainable last stage and classifier head, fp16 CPU autocast
with a GradScaler, AdamW built over *all* parameters (frozen ones are simply skipped by
the optimizer), and an EMA copy of the model (`copy.deepcopy`, `requires_grad_(False)`)
updated in fp32 under `torch.no_grad()` after every step with `lerp_`. Every 10 steps
the EMA model is evaluated under `torch.no_grad()` + autocast in eval mode, and accuracy
is computed on fp32/boolean tensors. No layer that receives gradients has vanishing
gradients, the scale never backs off, nothing is cast by hand. 30 optimizer steps.
"""
import copy
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
N_CLASSES = 6


def conv_bn_act(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn_act(3, 16, stride=2)
        self.stage1 = nn.Sequential(conv_bn_act(16, 32, 2), conv_bn_act(32, 32))
        self.stage2 = nn.Sequential(conv_bn_act(32, 64, 2), conv_bn_act(64, 64))

    def forward(self, x):
        return self.stage2(self.stage1(self.stem(x)))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, N_CLASSES))
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.head(self.pool(self.backbone(x)))


class ModelEma:
    def __init__(self, model, decay=0.99):
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(v.detach(), 1.0 - self.decay)
            else:
                ema_v.copy_(v)


def make_data(g, n):
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    colors = torch.linspace(-1, 1, N_CLASSES)
    x = torch.randn(n, 3, 32, 32, generator=g) * 0.8
    x[:, 0] += colors[y].view(-1, 1, 1)
    rows = torch.arange(32).view(1, -1, 1) < (8 + 8 * (y % 3)).view(-1, 1, 1)   # class-dependent band
    x[:, 1] += 0.7 * rows
    return x, y


def freeze_early_layers(model):
    model.backbone.stem.requires_grad_(False)
    model.backbone.stage1.requires_grad_(False)
    model.backbone.stem.eval()
    model.backbone.stage1.eval()


def train():
    g = torch.Generator().manual_seed(1)
    model = Classifier()
    freeze_early_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu")
    ema = ModelEma(model)
    x_val, y_val = make_data(g, 64)
    for step in range(30):
        model.train()
        freeze_early_layers(model)      # keep frozen BN statistics fixed
        x, y = make_data(g, 32)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 5.0)
        scaler.step(optimizer)
        scaler.update()
        ema.update(model)
        if step % 10 == 9:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                val_logits = ema.module(x_val)
            acc = (val_logits.argmax(-1) == y_val).float().mean().item()
            if DEBUG:
                print(f"step {step} ema val acc {acc:.3f}", file=sys.stderr)
        if DEBUG:
            print(f"step {step} loss {loss.item():.4f} norm {norm.item():.3f} scale {scaler.get_scale()}",
                  file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
