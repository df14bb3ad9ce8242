"""A small, correct mixed-precision training loop that runs on a CPU in seconds.

It follows the PyTorch AMP recipe: fp32 weights, ``torch.autocast`` around the forward
pass and the loss only, and with fp16 a ``GradScaler`` whose gradients are unscaled
before clipping. ``flake8 --select=AMP`` finds nothing here, and
``python -m amp_runtime run examples/train_healthy.py`` reports a healthy run.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class Classifier(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features, hidden),
            nn.GELU(),
            nn.LayerNorm(hidden),
            nn.Linear(hidden, hidden),
            nn.GELU(),
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def make_dataset(samples: int, features: int, classes: int, generator: torch.Generator):
    """Gaussian clusters, one per class, around random centres."""
    centres = torch.randn(classes, features, generator=generator) * 0.35
    labels = torch.randint(classes, (samples,), generator=generator)
    inputs = centres[labels] + torch.randn(samples, features, generator=generator)
    return inputs, labels


def example():
    """``(model, inputs)`` for ``python -m amp_runtime compare examples/train_healthy.py:example``."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    inputs, _ = make_dataset(256, 32, 8, generator)
    return Classifier(32, 128, 8), inputs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps (default: 80)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                        help="autocast dtype; float16 also uses a GradScaler (default: float16)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    use_scaler = dtype == torch.float16

    inputs, labels = make_dataset(4096, 32, 8, generator)
    model = Classifier(32, 128, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # bf16 has fp32's exponent range and needs no loss scaling.
    scaler = torch.amp.GradScaler("cpu", enabled=use_scaler)

    model.train()
    for step in range(args.steps):
        batch = torch.randint(len(inputs), (args.batch_size,), generator=generator)
        x, y = inputs[batch], labels[batch]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scaler.get_scale():g}")

    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        accuracy = (model(inputs).argmax(dim=1) == labels).float().mean().item()
    print(f"accuracy {accuracy:.3f} after {args.steps} steps ({args.dtype})")


if __name__ == "__main__":
    main()
