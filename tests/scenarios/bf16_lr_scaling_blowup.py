"""EXPECT: AMP101 AMP103 AMP104 AMP112

FAULT: a bad constant in the linear scaling rule, `LR = BASE_LR * BATCH / 2.56` (meant
256): the SGD (nesterov, momentum 0.9) learning rate is 0.75 instead of 0.0075. bf16
autocast with no GradScaler (correct for bf16), no clipping; a 15-step warmup, evaluation
every 10 steps under no_grad and bf16 autocast, and batches whose records are all unlabelled
(8 of 300) skipped with `continue` before the forward. The model fits the easy clusters in
10 steps (val acc 0.996), then the warmup drives it over the edge: total grad norm 3.6 at
step 14, 153 at step 15, 71969 at 16, 1.1e12 at 17, inf at 18 (every gradient still finite,
max 9e27: the norm's sum of squares overflows fp32), weights up to 1.3e28 before step 19.
- AMP104: the unclipped norm exceeds 100 at step 15 and 1000 at step 16.
- AMP101: at step 19 a bf16 linear of the model overflows to inf from finite weights and
  inputs (the replay runs before the optimizer applies the step on the CPU).
- AMP112: the loss is NaN from step 19 to the end.
- AMP103: no scaler: the NaN gradients of step 19 reach optimizer.step() and the weights
  become NaN for good.
Must stay silent: AMP010 (bf16 without a scaler is right), AMP106 (no scaler, bf16),
AMP102 (no fp16).
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

IN_DIM, HIDDEN, N_CLASSES, BATCH = 64, 512, 12, 384
STEPS, WARMUP = 300, 15
BASE_LR = 0.005                      # tuned for a batch of 256
LR = BASE_LR * BATCH / 2.56          # linear scaling rule: lr = base_lr * batch / 256
IGNORE = -100
EVAL_EVERY, LOG_EVERY = 10, 10


class MLPClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(IN_DIM, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
        )
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.layers(x))


class LabelledStream:
    """Gaussian clusters; some records carry no label (IGNORE) and are filtered out."""

    def __init__(self, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.centers = 2.0 * torch.randn(N_CLASSES, IN_DIM, generator=self.g)

    def batch(self, step=None):
        n = BATCH
        y = torch.randint(0, N_CLASSES, (n,), generator=self.g)
        x = self.centers[y] + torch.randn(n, IN_DIM, generator=self.g)
        unlabelled = torch.rand(n, generator=self.g) < 0.1
        if step is not None and step % 37 == 36:
            unlabelled[:] = True          # a shard written before labelling started
        y[unlabelled] = IGNORE
        return x, y


def lr_at(step):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


@torch.no_grad()
def evaluate(model, val):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in val:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
        total += y.numel()
    model.train()
    return loss_sum / total, correct / total


def main():
    model = MLPClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4, nesterov=True)
    stream = LabelledStream()
    val_stream = LabelledStream(seed=0)
    val_stream.g.manual_seed(4242)
    val = []
    for _ in range(2):
        x, y = val_stream.batch()
        keep = y != IGNORE
        val.append((x[keep], y[keep]))
    t0 = time.time()
    skipped = 0
    with amp_runtime.guard(policy="record", model=model) as g:
        for step in range(STEPS):
            x, y = stream.batch(step)
            keep = y != IGNORE
            x, y = x[keep], y[keep]
            if y.numel() == 0:
                skipped += 1
                continue                      # nothing labelled in this batch
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
            loss.backward()
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % LOG_EVERY == 0:
                print(f"step {step:3d} loss {loss.item():10.4f} grad_norm {grad_norm.item():10.3f} lr {lr_at(step):.3e}")
            if step % EVAL_EVERY == EVAL_EVERY - 1:
                val_loss, acc = evaluate(model, val)
                print(f"step {step:3d} val_loss {val_loss:10.4f} val_acc {acc:.3f}")
    print(f"done in {time.time() - t0:.1f}s, skipped empty batches {skipped}")
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
