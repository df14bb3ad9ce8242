"""
Attention-MIL whole-slide classifier (CLAM-style) as a LightningModule.

Manual optimization: the bag-level model and the per-class instance heads are stepped by
separate optimizers, bags (one slide each) are accumulated over ``accumulate`` steps, and
an optional site-adversarial head is trained through a gradient-reversal layer.

    python -m wsi.train_mil --features /data/tcga_brca/feats --precision 16-mixed
"""
import argparse
import copy
import logging
from typing import Dict, Optional

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning_utilities.core.apply_func import apply_to_collection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from .datamodule import SlideDataModule

log = logging.getLogger(__name__)


class _GradReverse(torch.autograd.Function):
    """Identity forward, negated (and scaled) gradient backward."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x, lambd):
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        return -ctx.lambd * grad_output, None


def grad_reverse(x, lambd=1.0):
    return _GradReverse.apply(x, lambd)


class GatedAttentionPool(nn.Module):
    """Ilse et al. gated attention; returns pooled features and attention weights."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.25, n_heads: int = 1):
        super().__init__()
        self.attn_a = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Dropout(dropout))
        self.attn_b = nn.Sequential(nn.Linear(dim, hidden), nn.Sigmoid(), nn.Dropout(dropout))
        self.attn_c = nn.Linear(hidden, n_heads)

    def forward(self, h, mask: Optional[torch.Tensor] = None):
        scores = self.attn_c(self.attn_a(h) * self.attn_b(h)).transpose(-1, -2)  # B, heads, N
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(1), torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        pooled = weights @ h  # B, heads, D
        return pooled, weights


class MILClassifier(pl.LightningModule):
    def __init__(
        self,
        in_dim: int = 1024,
        hidden: int = 512,
        num_classes: int = 2,
        k_sample: int = 8,
        bag_weight: float = 0.7,
        lr: float = 2e-4,
        inst_lr: float = 1e-3,
        weight_decay: float = 1e-5,
        accumulate: int = 4,
        num_sites: int = 0,
        adv_weight: float = 0.1,
        precision: str = "32-true",
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        self.fc = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(0.25))
        self.pool = GatedAttentionPool(hidden, hidden // 2)
        self.classifier = nn.Linear(hidden, num_classes)
        self.instance_heads = nn.ModuleList([nn.Linear(hidden, 2) for _ in range(num_classes)])
        self.site_head = nn.Linear(hidden, num_sites) if num_sites > 0 else None

        self.train_acc = MulticlassAccuracy(num_classes=num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self.val_auc = MulticlassAUROC(num_classes=num_classes)

    def configure_model(self):
        if self.hparams.precision == "bf16-true":
            self.fc = self.fc.bfloat16()

    def forward(self, feats, mask=None) -> Dict[str, torch.Tensor]:
        h = self.fc(feats)
        pooled, attn = self.pool(h, mask)
        pooled = pooled.squeeze(1)
        return {"logits": self.classifier(pooled), "attn": attn, "h": h, "pooled": pooled}

    def _instance_loss(self, attn, h, label: int):
        # top-k patches of the true class are positives, bottom-k negatives
        k = min(self.hparams.k_sample, h.size(0) // 2)
        a = attn.reshape(-1)
        top_p = torch.topk(a, k).indices
        top_n = torch.topk(-a, k).indices
        inst = torch.cat([h[top_p], h[top_n]], dim=0)
        targets = torch.cat([torch.ones(k, device=h.device), torch.zeros(k, device=h.device)]).long()
        logits = self.instance_heads[label](inst)
        return F.cross_entropy(logits, targets)

    def training_step(self, batch, batch_idx):
        opt_bag, opt_inst = self.optimizers()
        feats = apply_to_collection(batch["feats"], torch.Tensor, lambda t: t.to(torch.float16))  # expect: AMP001
        label = batch["label"]
        out = self(feats.unsqueeze(0))
        bag_loss = F.cross_entropy(out["logits"], label)
        inst_loss = self._instance_loss(out["attn"], out["h"][0], int(label.item()))
        loss = self.hparams.bag_weight * bag_loss + (1.0 - self.hparams.bag_weight) * inst_loss

        if self.site_head is not None and "site" in batch:
            site_logits = self.site_head(grad_reverse(out["pooled"], self.hparams.adv_weight))
            loss = loss + F.cross_entropy(site_logits, batch["site"])

        self.manual_backward(loss / self.hparams.accumulate)
        if (batch_idx + 1) % self.hparams.accumulate == 0:
            self.clip_gradients(opt_bag, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt_bag.step()
            opt_inst.step()
            opt_bag.zero_grad(set_to_none=True)
            opt_inst.zero_grad(set_to_none=True)

        self.train_acc(out["logits"].argmax(-1), label)
        self.log_dict(
            {"train/loss": loss.detach(), "train/bag_loss": bag_loss.detach(), "train/inst_loss": inst_loss.detach()},
            on_step=True, on_epoch=True, batch_size=1,
        )
        self.log("train/acc", self.train_acc, on_epoch=True, batch_size=1)
        return loss.detach()

    def on_train_epoch_end(self):
        for sched in self.lr_schedulers() or []:
            sched.step()

    def validation_step(self, batch, batch_idx):
        label = batch["label"]
        out = self(batch["feats"].unsqueeze(0))
        loss = F.cross_entropy(out["logits"], label)
        probs = out["logits"].float().softmax(-1)
        self.val_acc(probs.argmax(-1), label)
        self.val_auc(probs, label)
        self.log("val/loss", loss, on_epoch=True, batch_size=1)
        self.log("val/acc", self.val_acc, on_epoch=True, batch_size=1)
        self.log("val/auc", self.val_auc, on_epoch=True, batch_size=1, prog_bar=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        feats = batch["feats"]
        if self.hparams.precision.startswith("16"):
            feats = feats.half()
        out = self(feats.unsqueeze(0))
        return {"slide_id": batch["slide_id"], "probs": out["logits"].float().softmax(-1), "attn": out["attn"].float()}

    def configure_optimizers(self):
        bag_params = list(self.fc.parameters()) + list(self.pool.parameters()) + list(self.classifier.parameters())
        if self.site_head is not None:
            bag_params += list(self.site_head.parameters())
        opt_bag = torch.optim.Adam(bag_params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        opt_inst = torch.optim.SGD(self.instance_heads.parameters(), lr=self.hparams.inst_lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt_bag, T_max=self.trainer.max_epochs)
        return [opt_bag, opt_inst], [sched]

    def on_save_checkpoint(self, checkpoint):
        # slim copy for the viewer service, next to the full-precision weights
        checkpoint["viewer_state_dict"] = {k: v.half() for k, v in self.state_dict().items()}

    def export_onnx(self, path, n_patches: int = 2048):
        deploy = copy.deepcopy(self).half().eval()
        dummy = torch.randn(1, n_patches, self.hparams.in_dim, dtype=torch.float16, device=self.device)
        torch.onnx.export(
            deploy,
            (dummy,),
            path,
            input_names=["feats"],
            output_names=["logits"],
            dynamic_axes={"feats": {1: "n_patches"}},
            opset_version=17,
        )
        return path


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--features", required=True)
    p.add_argument("--splits", default="splits/task_1_tumor_vs_normal_100")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--num-classes", type=int, default=2)
    p.add_argument("--in-dim", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--precision", default="16-mixed")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-sites", type=int, default=0)
    p.add_argument("--out", default="runs/mil")
    p.add_argument("--export", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    pl.seed_everything(1234 + args.fold, workers=True)
    dm = SlideDataModule(args.features, args.splits, fold=args.fold, num_workers=4)
    model = MILClassifier(
        in_dim=args.in_dim,
        num_classes=args.num_classes,
        accumulate=args.accumulate,
        num_sites=args.num_sites,
        precision=args.precision,
    )
    ckpt = ModelCheckpoint(dirpath=args.out, monitor="val/auc", mode="max", save_last=True)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        precision=args.precision,
        max_epochs=args.epochs,
        callbacks=[ckpt, LearningRateMonitor("epoch")],
        log_every_n_steps=20,
        deterministic=False,
    )
    trainer.fit(model, datamodule=dm)
    best = MILClassifier.load_from_checkpoint(ckpt.best_model_path)
    preds = trainer.predict(best, datamodule=dm)
    torch.save(preds, f"{args.out}/predictions_fold{args.fold}.pt")
    if args.export:
        best.export_onnx(f"{args.out}/mil_fold{args.fold}.onnx")
    log.info("best val/auc %.4f", float(ckpt.best_model_score))


if __name__ == "__main__":
    main()
