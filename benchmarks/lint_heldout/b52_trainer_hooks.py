"""Callback-driven supervised trainer for image classification.

The Trainer owns the model, the optimizer and the mixed-precision state; callbacks
see it through ``trainer`` and must not touch the scaler.  Runs launched before the
move to ``torch.amp`` used ``torch.cuda.amp.GradScaler``; their ``scaler`` state
dicts load unchanged into ``torch.amp.GradScaler("cuda")``.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("trainer")

PRECISIONS = {"32": torch.float32, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


@dataclass
class TrainerConfig:
    num_classes: int = 1000
    max_epochs: int = 90
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    mixup_alpha: float = 0.0
    precision: str = "16-mixed"
    grad_clip: Optional[float] = None
    accumulate: int = 1
    channels_last: bool = True
    log_every: int = 100
    ckpt_dir: str = "checkpoints"
    callbacks: List[str] = field(default_factory=lambda: ["lr", "ckpt", "ema"])

    @property
    def amp_enabled(self) -> bool:
        return self.precision != "32"

    @property
    def amp_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]


class Callback:
    def on_fit_start(self, trainer: "Trainer") -> None:
        pass

    def on_batch_end(self, trainer: "Trainer", step: int, logs: Dict[str, float]) -> None:
        pass

    def on_epoch_end(self, trainer: "Trainer", epoch: int, logs: Dict[str, float]) -> None:
        pass

    def on_fit_end(self, trainer: "Trainer") -> None:
        pass


class LRLogger(Callback):
    def on_batch_end(self, trainer, step, logs):
        if step % trainer.cfg.log_every == 0:
            lr = trainer.optimizer.param_groups[0]["lr"]
            scale = trainer.scaler.get_scale() if trainer.scaler is not None else 1.0
            log.info("step %d lr %.5f loss %.4f scale %.0f", step, lr, logs["loss"], scale)


class EMACallback(Callback):
    """Exponential moving average of the weights, kept in half precision for cheap eval."""

    def __init__(self, decay: float = 0.9998):
        self.decay = decay
        self.ema = None

    def on_fit_start(self, trainer):
        self.ema = copy.deepcopy(trainer.model).eval().half()
        self.ema.requires_grad_(False)

    @torch.no_grad()
    def on_batch_end(self, trainer, step, logs):
        for e, p in zip(self.ema.parameters(), trainer.model.parameters()):
            e.mul_(self.decay).add_(p.detach().half(), alpha=1 - self.decay)


class CheckpointCallback(Callback):
    def __init__(self, directory: str):
        self.directory = directory
        self.best = float("inf")

    def on_epoch_end(self, trainer, epoch, logs):
        os.makedirs(self.directory, exist_ok=True)
        state = {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
            "epoch": epoch,
            "config": asdict(trainer.cfg),
        }
        torch.save(state, os.path.join(self.directory, "last.pt"))
        if logs.get("val_loss", float("inf")) < self.best:
            self.best = logs["val_loss"]
            # weights-only copy in half precision for the model zoo
            half_weights = {k: v.half() for k, v in trainer.model.state_dict().items()}
            torch.save(half_weights, os.path.join(self.directory, "best_fp16.pt"))


class Trainer:
    def __init__(self, model: nn.Module, cfg: TrainerConfig, callbacks: Optional[List[Callback]] = None):
        self.cfg = cfg
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(self.device)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
            weight_decay=cfg.weight_decay, nesterov=True,
        )
        self.scaler = torch.amp.GradScaler("cuda") if cfg.precision == "16-mixed" else None
        self.callbacks = callbacks if callbacks is not None else [
            LRLogger(), EMACallback(), CheckpointCallback(cfg.ckpt_dir)
        ]

    @classmethod
    def from_checkpoint(cls, path: str, model: nn.Module, cfg: TrainerConfig) -> "Trainer":
        trainer = cls(model, cfg)
        ckpt = torch.load(path, map_location="cpu")
        trainer.model.load_state_dict(ckpt["model"])
        trainer.optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scaler") is not None:
            if trainer.scaler is None:
                trainer.scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
            trainer.scaler.load_state_dict(ckpt["scaler"])
        return trainer

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def training_step(self, batch, step: int) -> torch.Tensor:
        images, targets = batch
        images = images.to(self.device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
        targets = targets.to(self.device, non_blocking=True)
        if self.cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        soft_targets = None
        if self.cfg.mixup_alpha > 0:
            lam = float(np.random.beta(self.cfg.mixup_alpha, self.cfg.mixup_alpha))
            perm = torch.randperm(images.size(0), device=self.device)
            images = lam * images + (1 - lam) * images[perm]
            onehot = F.one_hot(targets, self.cfg.num_classes).type(torch.cuda.HalfTensor)  # expect: AMP001
            soft_targets = lam * onehot + (1 - lam) * onehot[perm]

        with torch.autocast(device_type=self.device.type, dtype=self.cfg.amp_dtype,
                            enabled=self.cfg.amp_enabled):
            logits = self.model(images)
            loss = self.criterion(logits, soft_targets if soft_targets is not None else targets)
        loss = loss / self.cfg.accumulate

        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        if (step + 1) % self.cfg.accumulate == 0:
            self._optimizer_step()
        return loss.detach() * self.cfg.accumulate

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            if self.cfg.grad_clip:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.cfg.grad_clip:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, loader) -> Dict[str, float]:
        self.model.eval()
        total, correct, loss_sum = 0, 0, 0.0
        for images, targets in loader:
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with torch.autocast(device_type=self.device.type, dtype=self.cfg.amp_dtype,
                                enabled=self.cfg.amp_enabled):
                logits = self.model(images)
                loss_sum += self.criterion(logits, targets).item() * targets.size(0)
            correct += (logits.argmax(dim=1) == targets).sum().item()
            total += targets.size(0)
        self.model.train()
        return {"val_loss": loss_sum / max(total, 1), "val_acc": correct / max(total, 1)}

    def fit(self, train_loader, val_loader=None) -> None:
        self._call("on_fit_start")
        step = 0
        for epoch in range(self.cfg.max_epochs):
            self.model.train()
            t0 = time.time()
            for batch in train_loader:
                loss = self.training_step(batch, step)
                self._call("on_batch_end", step, {"loss": loss.item()})
                step += 1
            logs = {"epoch_time": time.time() - t0}
            if val_loader is not None:
                logs.update(self.evaluate(val_loader))
            self._call("on_epoch_end", epoch, logs)
        self._call("on_fit_end")

    def export_torchscript(self, path: str, example: torch.Tensor) -> None:
        model = copy.deepcopy(self.model).eval().half()
        with torch.no_grad():
            traced = torch.jit.trace(model, example.to(self.device).half())
        traced.save(path)


def linear_probe(backbone: nn.Module, head: nn.Module, loader, epochs: int = 5, lr: float = 1e-3):
    """Quick linear probe on frozen features, run by the ``probe`` hook after pre-training."""
    backbone.eval().requires_grad_(False)
    head.train()
    opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9)
    for _ in range(epochs):
        for images, targets in loader:
            images = images.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            with torch.no_grad():
                feats = backbone(images)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(head(feats), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return head


def build_trainer(model: nn.Module, overrides: Dict[str, object]) -> Trainer:
    cfg = TrainerConfig(**overrides)
    callbacks: List[Callback] = []
    if "lr" in cfg.callbacks:
        callbacks.append(LRLogger())
    if "ema" in cfg.callbacks:
        callbacks.append(EMACallback())
    if "ckpt" in cfg.callbacks:
        callbacks.append(CheckpointCallback(cfg.ckpt_dir))
    return Trainer(model, cfg, callbacks)
