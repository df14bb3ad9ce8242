"""EXPECT: AMP001
MAY: AMP010
FAULT: a Lightning `Trainer(precision="bf16-mixed", accelerator="cpu")` run of a small
encoder/head LightningModule in which the module casts its own encoder to fp16 by hand
after a warm-up, `self.encoder.half()` in `on_train_batch_start` when `batch_idx == 4`
(a "save memory once training is stable" switch). Lightning runs the fit loop with grad
mode on (`fit_loop` calls `torch.set_grad_enabled(True)`; checked in a plain run:
`torch.is_grad_enabled()` is True in that hook), the encoder's parameters require grad,
and the SGD optimizer keeps stepping them, now as fp16 weights with fp16 gradients
(pure-fp16 training of the encoder inside a bf16-autocast run). AMP001's page: "At run
time the guard reports a module, or a tensor that requires grad, being cast to fp16/bf16
while grad mode is on" (DESIGN.md: "a module or a grad-requiring tensor is cast to
fp16/bf16 while grad mode is on"). The cast happens on training step 4, inside the first
`Thresholds.watch_steps` (8) steps, where the code-pattern rules see every call.
MAY AMP010: its page reports "an fp16 backward with no active scaler (under fp16 autocast
or through a model cast with `.half()`...)"; here the encoder's weights and gradients are
fp16 and no scaler exists, but the ops themselves run under bf16 autocast (the fp16
weights are cast to bf16 for the matmuls), so whether this counts as "an fp16 backward" is
left open by the page.
Nothing else: losses stay finite and small, gradients moderate (plain run).
"""
import json
import tempfile
import time
import warnings

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import amp_runtime  # noqa: E402

warnings.filterwarnings("ignore")
CAST_AT = 4


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 1, generator=g)
    x = torch.randn(n, 32, generator=g)
    y = torch.tanh(x @ w / 4.0) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU())
        self.head = nn.Linear(64, 1)
        self.losses = []
        self.info = {}

    def forward(self, x):
        return self.head(self.encoder(x))

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == CAST_AT:
            self.info["grad_enabled_at_cast"] = torch.is_grad_enabled()
            self.encoder.half()  # FAULT: manual fp16 cast of a trained submodule

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x)
        loss = F.mse_loss(pred, y)
        self.losses.append(round(loss.item(), 6))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main():
    pl.seed_everything(0, verbose=False)
    train = DataLoader(make_data(512, 4), batch_size=32, shuffle=True)
    model = Regressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=14,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
    )
    t0 = time.time()
    with amp_runtime.guard(policy="record") as g:
        trainer.fit(model, train)
    print(f"WALL {time.time() - t0:.2f}s")
    print("INFO", model.info, "encoder dtype", next(model.encoder.parameters()).dtype)
    print("LOSSES", model.losses)
    print("WEIGHTSUM", float(sum(p.detach().double().sum() for p in model.parameters())))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
