"""EXPECT: none
HEALTHY: a LightningModule with manual optimization (`self.automatic_optimization = False`)
trained in fp16 with a GradScaler on the CPU through Lightning's own precision plugin,
`Trainer(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])` (the
route docs/index.md names: "fp16 with a GradScaler runs through its
`MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))` plugin"). The step uses
`self.manual_backward(loss)` (Lightning scales the loss), gradient accumulation over 2
batches, `opt.step()` / `opt.zero_grad()` / `sched.step()` every 2nd batch; the
LightningOptimizer's step goes through the plugin, which runs `scaler.unscale_(opt)`, then
the `on_before_optimizer_step` hook, then `scaler.step(opt)` and `scaler.update()`.
Gradient clipping is done in `on_before_optimizer_step`, i.e. after Lightning's
`unscale_` (the correct place with a scaler in manual mode). The loss (`F.cross_entropy`)
is computed inside `training_step`, which Lightning runs under its fp16 autocast (CPU
autocast runs cross_entropy in fp32). Activations and gradients stay far below fp16's
range at the default scale 65536 (checked in a plain run: the scale never drops, no step
is skipped). REAL_WORLD_IDIOMS lists "Lightning (`Trainer(precision="16-mixed")`,
`manual_backward`)" among the wrappers that do the scaling and "must not produce
findings"; AMP005's page reports only clipping of grads "the scaler has scaled but not yet
unscaled"; AMP006's page only an optimizer "stepping on scaled gradients" or "a step that
passes without a scaler update". So no event is expected.
"""
import json
import tempfile
import time
import warnings

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import amp_runtime  # noqa: E402

warnings.filterwarnings("ignore")
ACCUM = 2


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(5, 24, generator=g) * 1.5
    y = torch.randint(0, 5, (n,), generator=g)
    x = centers[y] + torch.randn(n, 24, generator=g)
    return TensorDataset(x, y)


class ManualClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Sequential(nn.Linear(24, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU())
        self.head = nn.Linear(96, 5)
        self.losses = []
        self.scales = []

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        sched = self.lr_schedulers()
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.losses.append(round(loss.item(), 6))
        self.manual_backward(loss / ACCUM)
        if (batch_idx + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()
            sched.step()
            self.scales.append(self.trainer.precision_plugin.scaler.get_scale())
        self.log("train_loss", loss)

    def on_before_optimizer_step(self, optimizer):
        # Lightning has unscaled the gradients here (MixedPrecision.optimizer_step)
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=1.0)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return [opt], [sched]


def main():
    pl.seed_everything(0, verbose=False)
    train = DataLoader(make_data(640, 3), batch_size=16, shuffle=True)
    model = ManualClassifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))],
        max_epochs=1,
        limit_train_batches=32,
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
    print("LOSSES", model.losses)
    print("SCALES", model.scales)
    print("WEIGHTSUM", float(sum(p.detach().double().sum() for p in model.parameters())))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
