"""Generic trainer shared by the image-classification experiments.

Tasks subclass :class:`BaseTrainer` and implement ``compute_loss`` (and, when the
step needs more than one forward, override ``_train_step``).  Precision handling,
gradient accumulation, DDP, checkpointing and callbacks all live here so that the
task files stay short.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .meters import MetricLogger
from .sched import build_scheduler

logger = logging.getLogger(__name__)

PRECISIONS = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "pure_fp16": torch.float16,
}


@dataclass
class TrainerConfig:
    max_epochs: int = 100
    precision: str = "fp16"
    grad_accum_steps: int = 1
    max_grad_norm: Optional[float] = 1.0
    lr: float = 3e-4
    weight_decay: float = 0.05
    log_every: int = 50
    eval_every: int = 1
    output_dir: str = "outputs"
    resume: Optional[str] = None
    device: str = "cuda"
    extra: Dict[str, Any] = field(default_factory=dict)


class AmpContext:
    """Everything precision related for one run: autocast settings and the loss scaler."""

    def __init__(self, precision: str = "fp16", device_type: str = "cuda"):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        self.precision = precision
        self.device_type = device_type
        self.dtype = PRECISIONS[precision]
        self.enabled = precision in ("fp16", "bf16")
        self.scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer, parameters=None, max_norm=None):
        grad_norm = None
        if max_norm is not None and parameters is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)  # expect: AMP005
        self.scaler.step(optimizer)
        self.scaler.update()
        return grad_norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def state_dict(self) -> Dict[str, Any]:
        return {"precision": self.precision, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("precision") != self.precision:
            logger.warning("checkpoint was trained with precision=%s, now %s; not restoring the loss scale",
                           state.get("precision"), self.precision)
            return
        self.scaler.load_state_dict(state["scaler"])


class BaseTrainer:
    """Epoch / step loop shared by all tasks."""

    def __init__(self, model, optimizer, train_loader, val_loader=None, cfg=None, scheduler=None, callbacks=None):
        self.cfg = cfg or TrainerConfig()
        self.device = torch.device(self.cfg.device)
        self.model = model.to(self.device, memory_format=torch.channels_last)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.amp = AmpContext(self.cfg.precision, self.device.type)
        self.callbacks: List[Any] = list(callbacks or [])
        self.epoch = 0
        self.global_step = 0
        self.best_metric = -math.inf
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        if self.distributed:
            self.model = DDP(self.model, device_ids=[self.device.index])
        os.makedirs(self.cfg.output_dir, exist_ok=True)

    @property
    def unwrapped_model(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DDP) else self.model

    def fire(self, event: str, **kwargs) -> None:
        for cb in self.callbacks:
            hook = getattr(cb, event, None)
            if hook is not None:
                hook(self, **kwargs)

    # -- task specific -------------------------------------------------------
    def compute_loss(self, batch) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def monitor_metric(self, val_stats: Dict[str, float]) -> float:
        return -val_stats.get("loss", math.inf)

    # -- step plumbing ---------------------------------------------------------
    def move_batch(self, batch):
        images, targets = batch
        images = images.to(self.device, non_blocking=True, memory_format=torch.channels_last)
        return images, targets.to(self.device, non_blocking=True)

    def _is_update_step(self, micro_step: int) -> bool:
        return (micro_step + 1) % self.cfg.grad_accum_steps == 0

    def _sync_context(self, micro_step: int):
        # skip the gradient all-reduce on all but the last micro-batch
        if self.distributed and not self._is_update_step(micro_step):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _optimizer_update(self):
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self.amp.step(self.optimizer, params, self.cfg.max_grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.global_step += 1
        return grad_norm

    def _train_step(self, batch, micro_step: int) -> Dict[str, float]:
        batch = self.move_batch(batch)
        with self._sync_context(micro_step):
            with self.amp.autocast():
                losses = self.compute_loss(batch)
                loss = losses["loss"] / self.cfg.grad_accum_steps
            self.amp.backward(loss)
        if self._is_update_step(micro_step):
            grad_norm = self._optimizer_update()
            if grad_norm is not None:
                losses["grad_norm"] = grad_norm
        return {k: float(v) for k, v in losses.items()}

    @torch.no_grad()
    def _val_step(self, batch, micro_step: int) -> Dict[str, float]:
        batch = self.move_batch(batch)
        with self.amp.autocast():
            losses = self.compute_loss(batch)
        return {k: v.item() for k, v in losses.items()}

    def run_epoch(self, mode: str) -> Dict[str, float]:
        loader = self.train_loader if mode == "train" else self.val_loader
        step_fn = getattr(self, f"_{mode}_step")
        self.model.train(mode == "train")
        meters = MetricLogger(delimiter="  ")
        if self.distributed and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(self.epoch)
        for i, batch in enumerate(loader):
            out = step_fn(batch, i)
            meters.update(**out)
            if mode == "train" and i % self.cfg.log_every == 0 and self.rank == 0:
                logger.info("epoch %d [%d/%d] %s loss_scale=%.0f", self.epoch, i, len(loader), meters,
                            self.amp.loss_scale)
            self.fire(f"on_{mode}_batch_end", batch_idx=i, outputs=out)
        return {k: m.global_avg for k, m in meters.meters.items()}

    def fit(self):
        if self.cfg.resume:
            self.load_checkpoint(self.cfg.resume)
        self.fire("on_fit_start")
        for epoch in range(self.epoch, self.cfg.max_epochs):
            self.epoch = epoch
            t0 = time.time()
            logs = {f"train/{k}": v for k, v in self.run_epoch("train").items()}
            if self.val_loader is not None and (epoch + 1) % self.cfg.eval_every == 0:
                val_stats = self.run_epoch("val")
                logs.update({f"val/{k}": v for k, v in val_stats.items()})
                metric = self.monitor_metric(val_stats)
                if metric > self.best_metric:
                    self.best_metric = metric
                    self.save_checkpoint("best.pth")
            self.save_checkpoint("last.pth")
            logs["epoch_time"] = time.time() - t0
            self.fire("on_epoch_end", logs=logs)
        self.fire("on_fit_end")

    # -- checkpointing -----------------------------------------------------------
    def save_checkpoint(self, name: str) -> None:
        if self.rank != 0:
            return
        state = {
            "model": self.unwrapped_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "amp": self.amp.state_dict(),
            "epoch": self.epoch + 1,
            "global_step": self.global_step,
            "best_metric": self.best_metric,
            "cfg": asdict(self.cfg),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        torch.save(state, os.path.join(self.cfg.output_dir, name))

    def load_checkpoint(self, path: str) -> None:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        self.unwrapped_model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if "amp" in ckpt:
            self.amp.load_state_dict(ckpt["amp"])
        if self.scheduler is not None and "scheduler" in ckpt:
            self.scheduler.load_state_dict(ckpt["scheduler"])
        self.epoch = ckpt.get("epoch", 0)
        self.global_step = ckpt.get("global_step", 0)
        self.best_metric = ckpt.get("best_metric", -math.inf)
        logger.info("resumed from %s (epoch %d)", path, self.epoch)


class ClassificationTrainer(BaseTrainer):
    def __init__(self, *args, label_smoothing: float = 0.1, **kwargs):
        super().__init__(*args, **kwargs)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def compute_loss(self, batch):
        images, targets = batch
        logits = self.model(images)
        loss = self.criterion(logits, targets)
        acc = (logits.argmax(dim=-1) == targets).float().mean()
        return {"loss": loss, "acc": acc}

    def monitor_metric(self, val_stats):
        return val_stats["acc"]


class DistillationTrainer(ClassificationTrainer):
    """Logit distillation from a frozen teacher (Hinton et al.)."""

    def __init__(self, *args, teacher: nn.Module, temperature: float = 4.0, alpha: float = 0.7, **kwargs):
        super().__init__(*args, **kwargs)
        # the teacher only ever runs forward; half precision halves its memory
        self.teacher = teacher.to(self.device).half().eval()
        self.teacher.requires_grad_(False)
        self.kl = nn.KLDivLoss(reduction="batchmean")
        self.temperature = temperature
        self.alpha = alpha

    def _teacher_logits(self, images):
        with torch.no_grad():
            return self.teacher(images.half()).float()

    def _train_step(self, batch, micro_step):
        images, targets = self.move_batch(batch)
        teacher_logits = self._teacher_logits(images)
        with self._sync_context(micro_step):
            with self.amp.autocast():
                student_logits = self.model(images)
            T = self.temperature
            kd = self.kl(F.log_softmax(student_logits / T, dim=-1), F.softmax(teacher_logits / T, dim=-1)) * (T * T)  # expect: AMP002
            ce = self.criterion(student_logits, targets)  # expect: AMP002
            loss = self.alpha * kd + (1.0 - self.alpha) * ce
            self.amp.backward(loss / self.cfg.grad_accum_steps)
        if self._is_update_step(micro_step):
            self._optimizer_update()
        return {"loss": loss.item(), "kd": kd.item(), "ce": ce.item()}


class MixupTrainer(ClassificationTrainer):
    def __init__(self, *args, mixup_alpha: float = 0.8, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixup_alpha = mixup_alpha
        self.rng = np.random.default_rng(1234 + self.rank)

    def _train_step(self, batch, micro_step):
        images, targets = self.move_batch(batch)
        lam = float(self.rng.beta(self.mixup_alpha, self.mixup_alpha))
        perm = torch.randperm(images.size(0), device=images.device)
        mixed = lam * images + (1.0 - lam) * images[perm]
        with self._sync_context(micro_step):
            with self.amp.autocast():
                logits = self.model(mixed)
                loss = lam * self.criterion(logits, targets) + (1.0 - lam) * self.criterion(logits, targets[perm])
                self.amp.backward(loss / self.cfg.grad_accum_steps)  # expect: AMP008
        if self._is_update_step(micro_step):
            self._optimizer_update()
        return {"loss": loss.item()}


class EmaCallback:
    """Keeps an fp32 exponential moving average of the weights; writes a compact copy at the end."""

    def __init__(self, decay: float = 0.9998, every: int = 1):
        self.decay = decay
        self.every = every
        self.ema: Optional[nn.Module] = None

    def on_fit_start(self, trainer):
        self.ema = copy.deepcopy(trainer.unwrapped_model).eval().requires_grad_(False)

    @torch.no_grad()
    def on_train_batch_end(self, trainer, batch_idx, outputs):
        if trainer.global_step % self.every:
            return
        msd = trainer.unwrapped_model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1.0 - self.decay)

    def on_fit_end(self, trainer):
        if trainer.rank != 0:
            return
        path = os.path.join(trainer.cfg.output_dir, "ema_fp16.pth")
        torch.save({k: v.half() for k, v in self.ema.state_dict().items()}, path)


TRAINERS = {"cls": ClassificationTrainer, "kd": DistillationTrainer, "mixup": MixupTrainer}


def build_trainer(cfg: TrainerConfig, model: nn.Module, train_loader, val_loader=None, callbacks=None, **task_kwargs):
    task = cfg.extra.get("task", "cls")
    if cfg.precision == "pure_fp16":
        # weights, grads and optimizer state all in fp16 (no master copy); used for the memory ablation
        model = model.half()
    param_groups = [
        {"params": [p for n, p in model.named_parameters() if p.ndim > 1], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.ndim <= 1], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(0.9, 0.999))  # expect: AMP011
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch)
    trainer_cls = TRAINERS[task]
    return trainer_cls(model, optimizer, train_loader, val_loader, cfg=cfg, scheduler=scheduler,
                       callbacks=callbacks, **task_kwargs)
