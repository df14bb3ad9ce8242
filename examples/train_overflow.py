"""fp16 training that overflows in one layer: a factorization machine on raw counts.

The code follows the AMP recipe (autocast around forward and loss, GradScaler, unscale
before clipping). One thing it misses, and ``flake8 --select=AMP`` points at it: under
CPU autocast ``sum`` stays in fp16, so the interaction layer's two sums are AMP004.
Whether that matters depends on the data, which only the run shows: some batches carry
raw, unnormalised click counts, and the second-order interaction ``(sum v)^2`` of those
batches exceeds fp16's maximum of 65504. The forward pass turns to inf, GradScaler skips
the step and halves the loss scale, and the run keeps losing steps without any error.
Under ``python -m amp_runtime run examples/train_overflow.py`` the guard pins the first
non-finite op to ``interaction`` (AMP101), reports the fp16 sums there as they run
(AMP004) and the declining loss scale (AMP108).
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn


class PairwiseInteraction(nn.Module):
    """Second-order factorization-machine term: 0.5 * ((sum v)^2 - sum v^2)."""

    def forward(self, field_embeddings):
        square_of_sum = field_embeddings.sum(dim=1).pow(2)  # AMP004
        sum_of_squares = field_embeddings.pow(2).sum(dim=1)  # AMP004
        return 0.5 * (square_of_sum - sum_of_squares)


class FactorizationMachine(nn.Module):
    def __init__(self, fields: int, dim: int):
        super().__init__()
        self.fields, self.dim = fields, dim
        self.embed = nn.Linear(fields, fields * dim)
        self.interaction = PairwiseInteraction()
        self.head = nn.Linear(dim, 1)

    def forward(self, counts):
        field_embeddings = self.embed(counts).view(-1, self.fields, self.dim)
        return self.head(self.interaction(field_embeddings)).squeeze(-1)


def make_batch(step: int, batch_size: int, fields: int, generator: torch.Generator):
    """Normalised features, except every fourth batch: raw counts from a legacy source."""
    counts = torch.rand(batch_size, fields, generator=generator)
    if step % 4 == 3:
        counts = counts * 400.0
    targets = (counts[:, 0] > counts[:, 1]).float()
    return counts, targets


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    fields = 24
    model = FactorizationMachine(fields=fields, dim=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")

    model.train()
    for step in range(args.steps):
        counts, targets = make_batch(step, args.batch_size, fields, generator)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(counts)
            loss = F.binary_cross_entropy_with_logits(logits, targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:3d}  loss {loss.item():10.4f}  scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
