"""A small Lightning training script, as a user writes one, trained on the CPU.

    python lightning_train.py --precision bf16-mixed --steps 6 [--overflow-at N]
                              [--overflow-rank R] [--devices 2] [--callback] [--trace auto]
                              [--root DIR] [--losses FILE]

``--precision 16-mixed+scaler`` trains in fp16 with a CPU GradScaler through Lightning's own
precision plugin (``precision="16-mixed"`` on a CPU falls back to bf16). ``--devices 2``
trains with DDP (gloo) in two processes. The tests import it (``fit``) and run it as a
script, plain and under ``python -m amp_runtime run``.
"""
from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

SCALER = "16-mixed+scaler"


class Regressor(L.LightningModule):
    """The user's LightningModule; ``overflow_at`` makes one step overflow on purpose."""

    def __init__(self, overflow_at=None, overflow_rank=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.overflow_at = overflow_at
        self.overflow_rank = overflow_rank
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.global_step == self.overflow_at and self.overflow_rank in (None, self.global_rank):
            out = out * 1e39  # injected overflow
        loss = nn.functional.mse_loss(out.float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def batches():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(precision="bf16-mixed", steps=6, root="lightning-output", callbacks=(), devices=1):
    precision_options = (
        {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
        if precision == SCALER else {"precision": precision})
    return L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, default_root_dir=root,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=list(callbacks),
        **({"strategy": "ddp"} if devices > 1 else {}), **precision_options)


def fit(precision="bf16-mixed", steps=6, overflow_at=None, root="lightning-output",
        callbacks=(), devices=1, overflow_rank=None):
    """Train from a fixed seed; the losses of every step (of this process)."""
    torch.manual_seed(0)
    model = Regressor(overflow_at, overflow_rank)
    trainer(precision, steps, root, callbacks, devices).fit(model, batches())
    return model.losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-mixed",
                        choices=("bf16-mixed", "16-mixed", SCALER, "32-true"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--overflow-at", type=int)
    parser.add_argument("--overflow-rank", type=int)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--callback", action="store_true", help="add AmpGuardCallback")
    parser.add_argument("--trace", default="auto")
    parser.add_argument("--root", default="lightning-output")
    parser.add_argument("--losses", help="write the losses to this JSON file")
    options = parser.parse_args()
    callbacks = []
    if options.callback:
        from amp_runtime.integrations.lightning import AmpGuardCallback

        callbacks.append(AmpGuardCallback(policy="record", trace=options.trace))
    losses = fit(options.precision, options.steps, options.overflow_at, options.root, callbacks,
                 options.devices, options.overflow_rank)
    if options.losses and os.environ.get("LOCAL_RANK", "0") == "0":  # DDP: rank 0's
        with open(options.losses, "w", encoding="utf-8") as fh:
            json.dump(losses, fh)


if __name__ == "__main__":
    main()
