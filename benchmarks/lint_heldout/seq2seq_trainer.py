"""A small class-based trainer for a translation model, in the style of many research repos."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.utils.data import DataLoader

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    lr: float = 5e-4
    warmup: int = 4000
    max_epochs: int = 30
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    fp16: bool = True
    accum_steps: int = 2
    log_every: int = 100
    extra: Dict[str, float] = field(default_factory=dict)


class Seq2SeqTrainer:
    def __init__(self, model: nn.Module, train_loader: DataLoader, valid_loader: DataLoader,
                 cfg: TrainConfig, device: torch.device) -> None:
        self.model = model.to(device)
        self.train_loader = train_loader
        self.valid_loader = valid_loader
        self.cfg = cfg
        self.device = device
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._inverse_sqrt)
        self.scaler = GradScaler(enabled=cfg.fp16)  # expect: AMP009
        self.num_updates = 0

    def _inverse_sqrt(self, step: int) -> float:
        step = max(step, 1)
        return min(step / self.cfg.warmup, math.sqrt(self.cfg.warmup / step))

    def _move(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def compute_loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(batch["src"], batch["tgt_in"])
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)),
            batch["tgt_out"].view(-1),
            ignore_index=0,
            label_smoothing=self.cfg.label_smoothing,
        )

    def train_step(self, batch: Dict[str, torch.Tensor], step_idx: int) -> float:
        with autocast(enabled=self.cfg.fp16):  # expect: AMP009
            loss = self.compute_loss(batch) / self.cfg.accum_steps
        self.scaler.scale(loss).backward()
        if (step_idx + 1) % self.cfg.accum_steps == 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)  # expect: AMP005
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.num_updates += 1
        return loss.item() * self.cfg.accum_steps

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.valid_loader:
            batch = self._move(batch)
            with autocast(enabled=self.cfg.fp16):  # expect: AMP009
                total += self.compute_loss(batch).item()
            count += 1
        self.model.train()
        return total / max(count, 1)

    def fit(self) -> None:
        best = float("inf")
        for epoch in range(self.cfg.max_epochs):
            start = time.time()
            for i, batch in enumerate(self.train_loader):
                loss = self.train_step(self._move(batch), i)
                if self.num_updates % self.cfg.log_every == 0:
                    log.info(f"epoch {epoch} upd {self.num_updates} loss {loss:.3f} lr {self.scheduler.get_last_lr()[0]:.2e}")
            valid_loss = self.validate()
            log.info(f"epoch {epoch} valid {valid_loss:.3f} ({time.time() - start:.0f}s)")
            if valid_loss < best:
                best = valid_loss
                torch.save({"model": self.model.state_dict(), "scaler": self.scaler.state_dict()}, "best.pt")
