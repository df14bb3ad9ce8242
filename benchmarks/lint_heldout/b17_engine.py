"""Classification task for ``vislab``: losses, heads, hooks and the training engine.

Everything a classification experiment needs besides the backbone lives here.
Backbones come from ``vislab.models``; the engine is deliberately small: one
forward, one backward, one optimizer step, and a list of hooks that see a
read-only ``EngineState`` after every iteration.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class Registry:
    """Maps the ``type`` key of a config dict to a class or a factory."""

    def __init__(self, name: str):
        self.name = name
        self._items: Dict[str, Callable[..., Any]] = {}

    def register(self, name: Optional[str] = None):
        def deco(obj):
            key = name or obj.__name__
            if key in self._items:
                raise KeyError(f"{key} is already registered in {self.name}")
            self._items[key] = obj
            return obj

        return deco

    def build(self, cfg: Dict[str, Any]):
        cfg = dict(cfg)
        kind = cfg.pop("type")
        try:
            factory = self._items[kind]
        except KeyError as exc:
            raise KeyError(f"{kind!r} is not registered in {self.name}") from exc
        return factory(**cfg)


LOSSES = Registry("losses")
HEADS = Registry("heads")
HOOKS = Registry("hooks")


# ----------------------------------------------------------------------------- losses
@LOSSES.register("label_smoothing_ce")
class LabelSmoothingCrossEntropyLoss(nn.Module):
    def __init__(self, smoothing: float = 0.1):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logprobs = F.log_softmax(logits, dim=-1)
        nll = -logprobs.gather(dim=-1, index=target.unsqueeze(1)).squeeze(1)
        smooth = -logprobs.mean(dim=-1)
        return ((1.0 - self.smoothing) * nll + self.smoothing * smooth).mean()


# ------------------------------------------------------------------------------ heads
@HEADS.register("masked_attn_pool")
class MaskedAttentionPoolHead(nn.Module):
    """Attention pooling over a variable number of tokens; padded tokens are masked out."""

    def __init__(self, dim: int, num_classes: int, num_heads: int = 8, aux_classes: int = 0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.query = nn.Parameter(torch.zeros(1, 1, dim))
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, num_classes)
        self.aux_fc = nn.Linear(dim, aux_classes) if aux_classes else None
        nn.init.trunc_normal_(self.query, std=0.02)

    def forward(self, tokens: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        B, N, C = tokens.shape
        h = self.num_heads
        k, v = self.kv(tokens).reshape(B, N, 2, h, C // h).permute(2, 0, 3, 1, 4).unbind(0)
        q = self.query.expand(B, -1, -1).reshape(B, 1, h, C // h).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if padding_mask is not None:
            scores = scores.masked_fill(padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = scores.softmax(dim=-1)
        pooled = self.proj((attn @ v).transpose(1, 2).reshape(B, C))
        out = {"logits": self.fc(pooled)}
        if self.aux_fc is not None:
            out["aux"] = self.aux_fc(pooled)
        return out


@HEADS.register("token_pool")
class TokenPoolHead(nn.Module):
    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.score = nn.Linear(dim, 1)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        w = self.score(tokens).squeeze(-1)
        if padding_mask is not None:
            w = w.masked_fill(padding_mask, torch.finfo(w.dtype).min)
        w = w.softmax(dim=-1)
        pooled = torch.einsum("bn,bnc->bc", w, tokens)
        return {"logits": self.fc(pooled)}


# ------------------------------------------------------------------------------ hooks
@dataclass
class EngineState:
    epoch: int = 0
    iter: int = 0
    model: Optional[nn.Module] = None
    log_vars: Dict[str, float] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)


class Hook:
    priority = 50

    def before_epoch(self, state: EngineState) -> None:
        pass

    def after_iter(self, state: EngineState) -> None:
        pass

    def after_epoch(self, state: EngineState) -> None:
        pass


@HOOKS.register()
class EMAHook(Hook):
    priority = 40

    def __init__(self, momentum: float = 0.9998):
        self.momentum = momentum
        self.ema: Optional[nn.Module] = None

    def before_epoch(self, state: EngineState) -> None:
        if self.ema is None:
            self.ema = copy.deepcopy(state.model).eval()
            self.ema.requires_grad_(False)

    @torch.no_grad()
    def after_iter(self, state: EngineState) -> None:
        if self.ema is None:
            return
        for e, p in zip(self.ema.state_dict().values(), state.model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.momentum).add_(p.detach(), alpha=1.0 - self.momentum)
            else:
                e.copy_(p)


@HOOKS.register()
class CheckpointHook(Hook):
    priority = 80

    def __init__(self, out_dir: str, interval: int = 1, save_half: bool = True):
        self.out_dir, self.interval, self.save_half = out_dir, interval, save_half
        os.makedirs(out_dir, exist_ok=True)

    def after_epoch(self, state: EngineState) -> None:
        if state.epoch % self.interval:
            return
        sd = state.model.state_dict()
        if self.save_half:
            sd = {k: v.half() if v.is_floating_point() else v for k, v in sd.items()}
        path = os.path.join(self.out_dir, f"epoch_{state.epoch}.pth")
        torch.save({"epoch": state.epoch, "state_dict": sd, "metrics": state.metrics}, path)


# ----------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    max_epochs: int = 90
    fp16: bool = True
    grad_clip: Optional[float] = 3.0
    accum_steps: int = 1
    aux_weight: float = 0.4
    loss: Dict[str, Any] = field(default_factory=lambda: {"type": "label_smoothing_ce", "smoothing": 0.1})


class ClassificationEngine:
    def __init__(self, model: nn.Module, optimizer, scheduler, cfg: EngineConfig,
                 hooks: Sequence[Hook] = (), device: str = "cuda"):
        self.model = model.to(device)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = cfg
        self.device = device
        self.criterion = LOSSES.build(cfg.loss)
        self.aux_criterion = nn.BCELoss()
        self.scaler = torch.cuda.amp.GradScaler() if cfg.fp16 else None  # expect: AMP009
        self.hooks = sorted(hooks, key=lambda h: h.priority)
        self.state = EngineState(model=self.model)

    def _call_hooks(self, name: str) -> None:
        for hook in self.hooks:
            getattr(hook, name)(self.state)

    def _forward(self, batch: Dict[str, torch.Tensor]):
        images = batch["image"].to(self.device, non_blocking=True)
        targets = batch["label"].to(self.device, non_blocking=True)
        padding_mask = batch.get("padding_mask")
        if padding_mask is not None:
            padding_mask = padding_mask.to(self.device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.fp16):
            outputs = self.model(images, padding_mask=padding_mask)
            aux_loss = torch.zeros((), device=self.device)
            if "aux" in outputs and "aux_target" in batch:
                aux_target = batch["aux_target"].to(self.device, non_blocking=True).float()
                aux_loss = self.aux_criterion(torch.sigmoid(outputs["aux"]), aux_target)  # expect: AMP003
        loss = self.criterion(outputs["logits"], targets)  # expect: AMP002
        return loss + self.cfg.aux_weight * aux_loss, outputs

    def _backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _optimizer_step(self) -> Optional[torch.Tensor]:
        grad_norm = None
        if self.cfg.grad_clip:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)  # expect: AMP005
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_epoch(self, loader) -> None:
        self.model.train()
        self._call_hooks("before_epoch")
        meters: Dict[str, float] = defaultdict(float)
        t0 = time.time()
        for i, batch in enumerate(loader):
            loss, _ = self._forward(batch)
            self._backward(loss / self.cfg.accum_steps)
            if (i + 1) % self.cfg.accum_steps == 0:
                grad_norm = self._optimizer_step()
                if self.scheduler is not None:
                    self.scheduler.step()
                if grad_norm is not None:
                    meters["grad_norm"] = float(grad_norm)
            meters["loss"] = loss.item()
            meters["lr"] = self.optimizer.param_groups[0]["lr"]
            meters["time"] = time.time() - t0
            self.state.iter += 1
            self.state.log_vars = dict(meters)
            self._call_hooks("after_iter")
            t0 = time.time()
        self.state.epoch += 1

    @torch.no_grad()
    def evaluate(self, loader) -> Dict[str, float]:
        self.model.eval()
        correct = total = 0
        loss_sum = 0.0
        for batch in loader:
            images = batch["image"].to(self.device, non_blocking=True)
            targets = batch["label"].to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.fp16):
                logits = self.model(images)["logits"]
            loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").item()
            correct += (logits.argmax(dim=-1) == targets).sum().item()
            total += targets.numel()
        metrics = {"val_loss": loss_sum / max(total, 1), "top1": 100.0 * correct / max(total, 1)}
        self.state.metrics = metrics
        return metrics

    def run(self, train_loader, val_loader) -> None:
        while self.state.epoch < self.cfg.max_epochs:
            self.train_epoch(train_loader)
            self.evaluate(val_loader)
            self._call_hooks("after_epoch")


def build_optimizer(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.05):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
