"""EXPECT: none
HEALTHY: a Lightning `Trainer(precision="bf16-mixed", accelerator="cpu")` run of a small
LightningModule (LayerNorm/Linear/GELU/Dropout classifier on synthetic Gaussian clusters),
AdamW with a cosine LR schedule, `accumulate_grad_batches=2`, `gradient_clip_val=1.0`
(Lightning clips inside its precision plugin after the closure), a validation loop every
8 batches (Lightning runs it under `torch.inference_mode()` and `model.eval()`), and the
loss `F.cross_entropy` computed inside `training_step`, i.e. inside Lightning's autocast
region (CPU autocast runs cross_entropy in fp32). Accuracy is computed with `.float()`
before `.mean()`. Nothing is cast by hand, no scaler is used (bf16, correct per
REAL_WORLD_IDIOMS "bf16 autocast with no scaler (correct)"), backward runs outside
autocast (Lightning's closure), and no value comes near a limit. DESIGN.md: "a healthy
run prints nothing"; docs/index.md: "a healthy run prints nothing" for the callbacks, and
"Frameworks drive the loop: Lightning's precision plugin calls ..." is listed among what
the guard must handle. So no event is expected.
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


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=g) * 2.0
    y = torch.randint(0, 4, (n,), generator=g)
    x = centers[y] + torch.randn(n, 16, generator=g)
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(16),
            nn.Linear(16, 64),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(64, 64),
            nn.GELU(),
            nn.Linear(64, 4),
        )
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.losses.append(round(loss.item(), 6))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("val_acc", acc)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    pl.seed_everything(0, verbose=False)
    train = DataLoader(make_data(512, 1), batch_size=16, shuffle=True)
    val = DataLoader(make_data(64, 2), batch_size=32)
    model = Classifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=20,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        val_check_interval=8,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
    )
    t0 = time.time()
    with amp_runtime.guard(policy="record") as g:
        trainer.fit(model, train, val)
    print(f"WALL {time.time() - t0:.2f}s global_step={trainer.global_step}")
    print("LOSSES", model.losses)
    print("WEIGHTSUM", float(sum(p.detach().double().sum() for p in model.parameters())))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
