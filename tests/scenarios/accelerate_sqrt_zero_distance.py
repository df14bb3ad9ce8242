"""EXPECT: AMP103,AMP112
MAY: AMP104
FAULT: an accelerate loop, `Accelerator(mixed_precision="bf16", cpu=True)`, training a
siamese embedding model with a contrastive loss. The model's forward returns the euclidean
distance of each pair, `(a - p).float().pow(2).sum(-1).sqrt()` (upcast before the reduction,
so the reduction itself is fp32), and the loss `y*d^2 + (1-y)*relu(margin-d)^2` is built on
`d`. On training step 3 the data pipeline hands a batch in which one positive pair is an item
paired with itself (a duplicate row): its distance is exactly 0, the forward and the loss
are finite, but the backward of `sqrt` at 0 is infinite and meets a zero from `pow` (0*inf),
so that step's gradients are NaN. No GradScaler exists (bf16), `accelerator.clip_grad_norm_`
cannot fix a NaN norm, and the prepared AdamW steps on them: every weight becomes NaN (plain
run: loss finite through step 3, NaN from step 4 on).
AMP103's page: "Reports NaN/Inf gradients that reached an optimizer step without a
GradScaler catching them" (its own example is this `sqrt(0)` pair distance; with a finite
forward the replay names "the op, layer and source line whose backward first turned finite
gradients non-finite"). From step 4 on the NaN weights make the loss NaN when backward
starts: AMP112's page "Checks the tensor that backward() starts from and reports when it is
NaN or Inf" (and AMP103 again each step). No AMP101: the forward of step 3 is finite, and
after it every op has NaN weights among its inputs (AMP101 is "the first op whose output
holds NaN or Inf while all of its inputs were finite").
MAY AMP104: the pages say nothing about how a NaN total gradient norm is judged against
AMP104's "total grad norm > 100 / > 1000".
"""
import json
import time
import warnings

import torch

torch.set_num_threads(1)

import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import amp_runtime  # noqa: E402

warnings.filterwarnings("ignore")
N_ITEMS, DIM, BATCH, BAD_STEP, STEPS = 300, 32, 16, 3, 10


class PairDataset(Dataset):
    """Pairs of item ids with a same-class label; one batch carries an item paired with itself."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.cls = torch.randint(0, 10, (N_ITEMS,), generator=g)
        n = BATCH * STEPS
        self.a = torch.randint(0, N_ITEMS, (n,), generator=g)
        self.b = torch.randint(0, N_ITEMS, (n,), generator=g)
        self.b[BAD_STEP * BATCH + 5] = self.a[BAD_STEP * BATCH + 5]  # FAULT: duplicate row paired with itself
        self.y = (self.cls[self.a] == self.cls[self.b]).float()

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return self.a[i], self.b[i], self.y[i]


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(N_ITEMS, DIM)
        self.proj = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 32, bias=False))

    def forward(self, a, b):
        za, zb = self.proj(self.items(a)), self.proj(self.items(b))
        return (za - zb).float().pow(2).sum(-1).sqrt()


def contrastive(d, y, margin=2.0):
    return (y * d.pow(2) + (1 - y) * F.relu(margin - d).pow(2)).mean()


def main():
    set_seed(0)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = Siamese()
    loader = DataLoader(PairDataset(7), batch_size=BATCH, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, dmin = [], []
    t0 = time.time()
    with amp_runtime.guard(policy="record") as g:
        for a, b, y in loader:
            d = model(a, b)
            loss = contrastive(d, y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(round(loss.item(), 6))
            dmin.append(round(d.min().item(), 6))
    print(f"WALL {time.time() - t0:.2f}s")
    print("LOSSES", losses)
    print("DMIN", dmin)
    print("WEIGHTSUM", float(sum(p.detach().double().sum() for p in model.parameters())))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
