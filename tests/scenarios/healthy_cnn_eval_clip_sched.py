"""EXPECT: none

HEALTHY: a small CNN (Conv-BatchNorm-ReLU blocks, dropout, adaptive average pooling)
trained on synthetic 16x16 images with fp16 CPU autocast and a GradScaler, in the
torchvision-reference style: ``scaler.scale(loss).backward()``,
``scaler.unscale_(optimizer)``, ``clip_grad_norm_(..., 2.0)``, ``scaler.step``,
``scaler.update``, then ``OneCycleLR.step()`` every step. Every 6 steps it evaluates
on a held-out batch: ``model.eval()``, ``torch.no_grad()`` plus the same fp16
autocast, loss inside the region, accuracy as ``(pred == y).float().mean()`` (fp32),
then ``model.train()`` again. 24 training steps, 4 evaluations.

Pages: AMP005 (unscale_ before the clip), AMP006 (step then update), AMP010 (fp16
with an active scaler), AMP002 (losses inside the region in training and evaluation),
AMP008 (backward outside), AMP004 (no fp16 sum/mean/var/std is written: BatchNorm and
average pooling are not in its list, the accuracy mean is fp32), AMP001 (no casts:
``.float()`` on a bool tensor without grad), README idiom "Eval and sampling inside
the training script ... under torch.no_grad() and model.eval() every N iterations,
then back to model.train()". Gradient norms stay ~1. Nothing should be reported.
"""
import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

CLASSES = 5
prototypes = torch.randn(CLASSES, 3, 16, 16)


def make_batch(n):
    y = torch.randint(0, CLASSES, (n,))
    x = prototypes[y] + 0.7 * torch.randn(n, 3, 16, 16)
    return x, y


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


model = nn.Sequential(
    block(3, 16), block(16, 16), nn.MaxPool2d(2),
    block(16, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Dropout(0.2), nn.Linear(32, CLASSES),
)
STEPS = 24
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=STEPS)
scaler = torch.amp.GradScaler("cpu")
x_val, y_val = make_batch(64)


def evaluate():
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        logits = model(x_val)
        val_loss = F.cross_entropy(logits, y_val)
    acc = (logits.argmax(dim=1) == y_val).float().mean()
    model.train()
    return val_loss.item(), acc.item()


with amp_runtime.guard(policy="record") as g:
    model.train()
    for step in range(STEPS):
        x, y = make_batch(32)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % 6 == 5:
            val_loss, acc = evaluate()
            print(f"step {step:2d} loss {loss.item():.4f} grad-norm {norm.item():.3f} "
                  f"val-loss {val_loss:.4f} acc {acc:.3f} lr {scheduler.get_last_lr()[0]:.4f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
