"""Trainer abstraction shared by the image recipes.

Subclasses implement ``compute_loss``; the base class owns the loop, mixed precision,
gradient accumulation, clipping, evaluation and checkpointing.  Recipes pick a trainer
through ``TRAINERS[cfg.task]``.
"""
from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from recipes.data import build_loaders
from recipes.models import create_model
from recipes.utils import AverageMeter, param_groups_weight_decay

logger = logging.getLogger(__name__)


@dataclass
class TrainerConfig:
    task: str = "cls"
    arch: str = "resnet50"
    epochs: int = 90
    lr: float = 1e-3
    weight_decay: float = 0.05
    accum_steps: int = 1
    clip_grad: Optional[float] = 1.0
    amp: bool = True
    log_every: int = 50
    output_dir: str = "output"
    device: str = "cuda"


class BaseTrainer:
    def __init__(self, cfg: TrainerConfig, model, optimizer, train_loader, val_loader=None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.global_step = 0
        self.epoch = 0
        self.best_metric = -math.inf

    # ------------------------------------------------------------------ amp
    def autocast(self):
        if not self.cfg.amp:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.float16)

    def to_device(self, batch):
        if isinstance(batch, dict):
            return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return [t.to(self.device, non_blocking=True) for t in batch]

    # ---------------------------------------------------------- overridables
    def compute_loss(self, batch) -> Tuple[torch.Tensor, Dict[str, float]]:
        raise NotImplementedError

    def backward(self, loss):
        self.scaler.scale(loss / self.cfg.accum_steps).backward()

    def clip_gradients(self):
        if self.cfg.clip_grad is None:
            return None
        self.scaler.unscale_(self.optimizer)
        return nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)

    def optimizer_step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

    # ----------------------------------------------------------------- loop
    def train_one_epoch(self):
        self.model.train()
        loss_meter = AverageMeter()
        start = time.time()
        for i, batch in enumerate(self.train_loader):
            batch = self.to_device(batch)
            with self.autocast():
                loss, logs = self.compute_loss(batch)
            self.backward(loss)
            if (i + 1) % self.cfg.accum_steps != 0:
                continue
            grad_norm = self.clip_gradients()
            self.optimizer_step()

            loss_meter.update(loss.item())
            if self.global_step % self.cfg.log_every == 0:
                logger.info(
                    "epoch %d step %d loss %.4f grad_norm %s scale %.0f (%.1fs)",
                    self.epoch, self.global_step, loss_meter.avg,
                    "n/a" if grad_norm is None else f"{grad_norm:.3f}",
                    self.scaler.get_scale(), time.time() - start,
                )
        return {"train_loss": loss_meter.avg}

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        meter = AverageMeter()
        for batch in self.val_loader:
            batch = self.to_device(batch)
            with self.autocast():
                loss, _ = self.compute_loss(batch)
            meter.update(loss.item())
        self.model.train()
        return {"val_loss": meter.avg, "metric": -meter.avg}

    def benchmark(self, num_steps: int = 20):
        """Rough training throughput on one repeated batch (used by ``--benchmark``)."""
        self.model.train()
        batch = self.to_device(next(iter(self.train_loader)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(num_steps):
            with torch.autocast("cuda", dtype=torch.float16):
                loss, _ = self.compute_loss(batch)
                self.backward(loss)  # expect: AMP008
            self.optimizer_step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / num_steps
        logger.info("%.1f ms / step", dt * 1000)
        return dt

    # ----------------------------------------------------------- checkpoints
    def state_dict(self):
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "cfg": asdict(self.cfg),
        }

    def save(self, name="last.pth"):
        os.makedirs(self.cfg.output_dir, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(self.cfg.output_dir, name))

    def export_half(self, path):
        """Write an fp16 copy of the weights for the serving image."""
        model = copy.deepcopy(self.model).half().eval()
        torch.save(model.state_dict(), path)

    def fit(self):
        for epoch in range(self.epoch, self.cfg.epochs):
            self.epoch = epoch
            stats = self.train_one_epoch()
            if self.val_loader is not None:
                stats.update(self.evaluate())
                if stats["metric"] > self.best_metric:
                    self.best_metric = stats["metric"]
                    self.save("best.pth")
            self.save()
            logger.info("epoch %d: %s", epoch, stats)


class ClassificationTrainer(BaseTrainer):
    def __init__(self, *args, label_smoothing: float = 0.1, **kwargs):
        super().__init__(*args, **kwargs)
        self.label_smoothing = label_smoothing

    def compute_loss(self, batch):
        images, targets = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)
        return loss, {}


class MultiLabelTrainer(BaseTrainer):
    def __init__(self, *args, threshold: float = 0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.criterion = nn.BCEWithLogitsLoss()
        self.eval_criterion = nn.BCELoss()
        self.threshold = threshold

    def compute_loss(self, batch):
        logits = self.model(batch["image"])
        return self.criterion(logits, batch["labels"].float()), {}

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        total, count = 0.0, 0
        tp = fp = fn = 0
        for batch in self.val_loader:
            batch = self.to_device(batch)
            targets = batch["labels"].bool()
            with self.autocast():
                probs = torch.sigmoid(self.model(batch["image"]))
                total += self.eval_criterion(probs, targets.float()).item() * probs.size(0)  # expect: AMP003
            count += probs.size(0)
            preds = probs > self.threshold
            tp += (preds & targets).sum().item()
            fp += (preds & ~targets).sum().item()
            fn += (~preds & targets).sum().item()
        self.model.train()
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        return {"val_loss": total / max(count, 1), "metric": f1}


class SegmentationTrainer(BaseTrainer):
    """Semantic segmentation with the auxiliary FCN head and poly LR decay."""

    def __init__(self, *args, aux_weight: float = 0.4, ignore_index: int = 255, **kwargs):
        super().__init__(*args, **kwargs)
        self.aux_weight = aux_weight
        self.ignore_index = ignore_index
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]

    def seg_loss(self, logits, target):
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index)

    def compute_loss(self, batch):
        images, masks = batch
        out = self.model(images)
        return self.seg_loss(out["out"], masks), {}

    def poly_lr(self, it, total, power=0.9):
        factor = (1 - it / total) ** power
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def train_one_epoch(self):
        self.model.train()
        total_iters = self.cfg.epochs * len(self.train_loader)
        loss_meter = AverageMeter()
        for images, masks in self.train_loader:
            images = images.to(self.device, non_blocking=True)
            masks = masks.to(self.device, non_blocking=True)
            with self.autocast():
                out = self.model(images)
                loss = self.seg_loss(out["out"], masks)
                if "aux" in out:
                    loss = loss + self.aux_weight * self.seg_loss(out["aux"], masks)

            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            if self.cfg.clip_grad is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)  # expect: AMP005
            self.scaler.step(self.optimizer)
            self.scaler.update()

            self.global_step += 1
            self.poly_lr(self.global_step, total_iters)
            loss_meter.update(loss.item())
        return {"train_loss": loss_meter.avg}


class MultiTaskTrainer(BaseTrainer):
    """Dense multi-task learning with homoscedastic uncertainty weighting."""

    def __init__(self, *args, tasks=("seg", "depth"), **kwargs):
        super().__init__(*args, **kwargs)
        self.tasks = tasks
        self.log_vars = nn.Parameter(torch.zeros(len(tasks), device=self.device))
        self.weight_optimizer = torch.optim.Adam([self.log_vars], lr=self.cfg.lr * 10)

    def compute_loss(self, batch):
        out = self.model(batch["image"])
        seg = F.cross_entropy(out["seg"], batch["seg"], ignore_index=255)
        depth = F.l1_loss(out["depth"], batch["depth"])
        losses = torch.stack([seg, depth])
        loss = (torch.exp(-self.log_vars) * losses + self.log_vars).sum()
        return loss, {"seg": seg.item(), "depth": depth.item()}

    def optimizer_step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.weight_optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)
        self.weight_optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

    def state_dict(self):
        state = super().state_dict()
        state["log_vars"] = self.log_vars.detach().cpu()
        state["weight_optimizer"] = self.weight_optimizer.state_dict()
        return state


TRAINERS = {
    "cls": ClassificationTrainer,
    "multilabel": MultiLabelTrainer,
    "seg": SegmentationTrainer,
    "multitask": MultiTaskTrainer,
}


def parse_args():
    parser = argparse.ArgumentParser(description="image recipes")
    parser.add_argument("--task", default="cls", choices=sorted(TRAINERS))
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--no-amp", action="store_true")
    parser.add_argument("--benchmark", action="store_true")
    parser.add_argument("--output-dir", default="output")
    return parser.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = TrainerConfig(
        task=args.task, arch=args.arch, epochs=args.epochs, lr=args.lr,
        accum_steps=args.accum_steps, clip_grad=args.clip_grad, amp=not args.no_amp,
        output_dir=args.output_dir,
    )
    train_loader, val_loader = build_loaders(cfg)
    model = create_model(cfg.arch, task=cfg.task)
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, cfg.weight_decay), lr=cfg.lr)
    trainer = TRAINERS[cfg.task](cfg, model, optimizer, train_loader, val_loader)
    if args.benchmark:
        trainer.benchmark()
        return
    trainer.fit()
    trainer.export_half(os.path.join(cfg.output_dir, "model_fp16.pth"))


if __name__ == "__main__":
    main()
