"""EXPECT: AMP103
MAY: AMP104,AMP105

FAULT: a product-matching triplet network trained under bf16 CPU autocast (no GradScaler,
which is right for bf16). The encoder runs in bf16, the embeddings are upcast and
L2-normalised in fp32, and `TripletNet.forward` returns Euclidean distances written by hand
as `(a - p).pow(2).sum(-1).sqrt()` without an epsilon. The positive sampler draws another
item of the anchor's class, but product 17, with a single catalogue listing, returns the
anchor itself; the class-balanced sampler's shuffled pass reaches product 17 in the batch of
step 7 (0-based optimizer step). There d(anchor, positive) is exactly 0: the forward and the loss stay finite, but
the backward of `sqrt` at 0 is inf and, multiplied by the zero difference, NaN, so every
encoder parameter gets NaN gradients and AdamW steps on them (no scaler to catch them):
AMP103 at step 7, first non-finite in the backward of `sqrt` in the root module (the line
`return (a - p).pow(2).sum(-1).sqrt(), ...` in `TripletNet.forward`). No AMP101 (the
forward is finite) and no AMP112 (the loss is finite). The loop then sees a NaN loss at
step 8 (the weights are NaN) and stops before its backward (the timm/MAE `math.isfinite(loss)` check), so no
later backward starts from a NaN loss. NaN gradient norms leave AMP104/AMP105 open.
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
N_FEAT, N_CLASSES, EMB, BATCH, STEPS, MARGIN, SAMPLER_SEED = 32, 160, 32, 16, 20, 0.5, 1


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEAT, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                                 nn.Linear(128, EMB))

    def forward(self, x):
        return F.normalize(self.net(x).float(), dim=-1)


class TripletNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()

    def forward(self, anchor, positive, negative):
        a, p, n = self.encoder(anchor), self.encoder(positive), self.encoder(negative)
        return (a - p).pow(2).sum(-1).sqrt(), (a - n).pow(2).sum(-1).sqrt()


class Catalogue:
    """Items grouped by product id; product 17 has a single listing."""

    def __init__(self, g):
        protos = torch.randn(N_CLASSES, N_FEAT, generator=g)
        counts = torch.full((N_CLASSES,), 6)
        counts[17] = 1
        self.labels = torch.repeat_interleave(torch.arange(N_CLASSES), counts)
        self.items = protos[self.labels] + 1.2 * torch.randn(len(self.labels), N_FEAT, generator=g)
        self.by_class = [torch.nonzero(self.labels == c).flatten() for c in range(N_CLASSES)]

    def sample_positive(self, idx, g):
        same = self.by_class[int(self.labels[idx])]
        others = same[same != idx]
        if len(others) == 0:            # single-listing product: fall back to the item itself
            return idx
        return int(others[torch.randint(len(others), (1,), generator=g)])

    def sample_negative(self, idx, g):
        while True:
            j = int(torch.randint(len(self.labels), (1,), generator=g))
            if self.labels[j] != self.labels[idx]:
                return j

    def class_batches(self, seed):
        """Class-balanced sampling: a shuffled pass over the products, BATCH products per batch."""
        g = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(N_CLASSES, generator=g)
            for i in range(0, N_CLASSES - BATCH + 1, BATCH):
                yield order[i:i + BATCH]

    def batch(self, classes, g):
        anchors = [int(self.by_class[int(c)][torch.randint(len(self.by_class[int(c)]), (1,), generator=g)])
                   for c in classes]
        pos = [self.sample_positive(i, g) for i in anchors]
        neg = [self.sample_negative(i, g) for i in anchors]
        return self.items[anchors], self.items[pos], self.items[neg]


def train():
    g = torch.Generator().manual_seed(1)
    catalogue = Catalogue(g)
    model = TripletNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, classes in zip(range(STEPS), catalogue.class_batches(seed=SAMPLER_SEED)):
        anchor, positive, negative = catalogue.batch(classes, g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d_ap, d_an = model(anchor, positive, negative)
            loss = F.relu(d_ap - d_an + MARGIN).mean()
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training", file=sys.stderr)
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if DEBUG:
            bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
            print(f"step {step} loss {loss_value:.4f} min_d_ap {d_ap.min().item():.4f} nan_params {len(bad)}",
                  file=sys.stderr)


with amp_runtime.guard(policy="record") as g:
    train()

print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))
