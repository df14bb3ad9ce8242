"""EXPECT: AMP105
MAY: AMP106
FAULT: a 16-layer plain MLP with logistic (sigmoid) activations, ported from a legacy
model, is trained under bf16 autocast with SGD and PyTorch's default initialisation.
The sigmoid derivative is at most 0.25 and the default init shrinks the backward
signal further, so the gradient falls by roughly an order of magnitude per layer on
its way down. Measured without the guard, at every one of the 80 steps: the largest
|grad| of the first six Linear layers (`body.0` ... `body.10`) is between 1.6e-15
and 4.3e-11, far below AMP105's per-layer limit of 1e-10 (layer `body.0`: ~2e-15),
while the classifier's gradients are ~1e-2..1e-1 and the total norm stays between
0.06 and 1.1 (so it is the per-layer condition, not the total-norm one). AMP105 must
be reported from step 0 on. Accuracy stays at chance (~0.27 for 4 classes).
MAY AMP106: bf16 has the range for these values and the AMP106 page describes fp16
at "the current loss scale"; this run has no scaler and no fp16, so AMP106 is not
expected, but the pages do not say outright that a bf16 run is never judged for it.
Nothing is non-finite and no scaler is used, so no other code.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_runtime

torch.manual_seed(0)
torch.set_num_threads(1)

N_FEATURES = 32
N_CLASSES = 4
WIDTH = 64
DEPTH = 16
BATCH = 128
STEPS = 80


class DeepSigmoidNet(nn.Module):
    """A plain deep MLP with logistic activations (a port of a legacy Keras model)."""

    def __init__(self, depth=DEPTH, width=WIDTH):
        super().__init__()
        layers = [nn.Linear(N_FEATURES, width), nn.Sigmoid()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Sigmoid()]
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, N_CLASSES)

    def forward(self, x):
        return self.classifier(self.body(x))


def make_dataset(n=4096, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=gen)
    w = torch.randn(N_FEATURES, N_CLASSES, generator=gen)
    y = (x @ w + 0.5 * torch.randn(n, N_CLASSES, generator=gen)).argmax(dim=1)
    return x, y


def batches(x, y, seed=1):
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(x.shape[0], generator=gen)
        for i in range(0, x.shape[0] - BATCH + 1, BATCH):
            idx = perm[i:i + BATCH]
            yield x[idx], y[idx]


x_all, y_all = make_dataset()
model = DeepSigmoidNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
data = batches(x_all, y_all)

with amp_runtime.guard(policy="record", model=model) as g:
    for step in range(STEPS):
        xb, yb = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(xb)
            loss = F.cross_entropy(logits.float(), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == STEPS - 1:
            acc = (logits.argmax(dim=1) == yb).float().mean().item()
            print(f"step {step:4d}  loss {loss.item():.4f}  acc {acc:.3f}")

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
