"""EXPECT: AMP005
FAULT: the same manual-optimization LightningModule as lightning_manual_fp16_healthy.py
(fp16 autocast + GradScaler on the CPU through
`MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))`, `manual_backward`,
accumulation over 2 batches), but the gradients are clipped the way Lightning's own
docstring for manual optimization suggests, `self.clip_gradients(opt,
gradient_clip_val=1.0, gradient_clip_algorithm="norm")` in `training_step` right before
`opt.step()`. In manual mode Lightning's plugin unscales only inside `opt.step()`
(`MixedPrecision.optimizer_step`: `scaler.unscale_` after the closure), so this clip runs on
gradients that `manual_backward` scaled by 65536 and nobody has unscaled: the clip
threshold is applied in the scaled domain and the gradients the optimizer gets have a
total norm of about 1/65536 (AdamW's normalisation hides most of it here, plain SGD would
stall; a plain run still shows different losses from the healthy twin). AMP005's page: "At run time the guard
reports clipping that runs on gradients the scaler has scaled but not yet unscaled"
(DESIGN.md: "clipping runs on grads the scaler has scaled but not unscaled"). Nothing else
is wrong: the scale stays at 65536 (no overflow), the unscaled total norm after the wrong
clip is ~1.5e-5, above AMP105's 1e-6, and the optimizer still steps through
`scaler.step` + `scaler.update` (not AMP006).
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
            # FAULT: clips the still-scaled gradients (Lightning unscales only inside opt.step())
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched.step()
            self.scales.append(self.trainer.precision_plugin.scaler.get_scale())
        self.log("train_loss", loss)

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
