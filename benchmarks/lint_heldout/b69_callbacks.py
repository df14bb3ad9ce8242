"""Callback-driven training loop.

A stripped-down loop in the spirit of Lightning/Keras: the model implements
``training_step`` and returns ``{"loss": ...}``; everything else (clipping, EMA,
checkpointing, monitoring, linear probing) is a callback hooked into the loop.
"""
import copy
import logging
import math
import os
from contextlib import nullcontext
from typing import Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

log = logging.getLogger("loop")


class Callback:
    def on_fit_start(self, loop):
        pass

    def on_train_batch_start(self, loop, batch, batch_idx):
        pass

    def on_before_backward(self, loop, loss):
        pass

    def on_after_backward(self, loop):
        pass

    def on_before_optimizer_step(self, loop, optimizer):
        pass

    def on_train_batch_end(self, loop, loss, batch_idx):
        pass

    def on_train_epoch_end(self, loop):
        pass


class GradientClipping(Callback):
    def __init__(self, value: float = 1.0, algorithm: str = "norm"):
        assert algorithm in ("norm", "value")
        self.value = value
        self.algorithm = algorithm

    def on_before_optimizer_step(self, loop, optimizer):
        # grads are still multiplied by the loss scale at this point
        loop.scaler.unscale_(optimizer)
        if self.algorithm == "value":
            clip_grad_value_(loop.model.parameters(), self.value)
        else:
            norm = clip_grad_norm_(loop.model.parameters(), self.value)
            loop.metrics["grad_norm"] = norm.item()


class NonFiniteLossGuard(Callback):
    def on_before_backward(self, loop, loss):
        if not torch.isfinite(loss.detach()):
            raise FloatingPointError(f"non-finite loss at step {loop.global_step}: {loss.item()}")


class LossScaleMonitor(Callback):
    def __init__(self, every: int = 100):
        self.every = every
        self.last_scale = None

    def on_train_batch_end(self, loop, loss, batch_idx):
        if not loop.scaler.is_enabled() or loop.global_step % self.every:
            return
        scale = loop.scaler.get_scale()
        if self.last_scale is not None and scale < self.last_scale:
            log.warning("loss scale dropped %.0f -> %.0f", self.last_scale, scale)
        self.last_scale = scale
        loop.metrics["loss_scale"] = scale


class EMA(Callback):
    def __init__(self, decay: float = 0.9998):
        self.decay = decay
        self.shadow = None

    def on_fit_start(self, loop):
        self.shadow = copy.deepcopy(loop.model).eval().requires_grad_(False)

    @torch.no_grad()
    def on_train_batch_end(self, loop, loss, batch_idx):
        for ema_p, p in zip(self.shadow.parameters(), loop.model.parameters()):
            ema_p.lerp_(p.detach(), 1.0 - self.decay)


class ModelCheckpoint(Callback):
    def __init__(self, dirpath: str, every_n_epochs: int = 1):
        self.dirpath = dirpath
        self.every_n_epochs = every_n_epochs

    def on_train_epoch_end(self, loop):
        if (loop.epoch + 1) % self.every_n_epochs:
            return
        os.makedirs(self.dirpath, exist_ok=True)
        torch.save(
            {"model": loop.model.state_dict(), "optimizer": loop.optimizer.state_dict(),
             "scaler": loop.scaler.state_dict(), "epoch": loop.epoch},
            os.path.join(self.dirpath, f"epoch{loop.epoch:03d}.ckpt"),
        )


class LinearProbe(Callback):
    """Fits a linear classifier on frozen features every few epochs."""

    def __init__(self, loader, feat_dim: int, num_classes: int, every: int = 5, epochs: int = 2):
        self.loader = loader
        self.feat_dim = feat_dim
        self.num_classes = num_classes
        self.every = every
        self.epochs = epochs

    def on_train_epoch_end(self, loop):
        if (loop.epoch + 1) % self.every:
            return
        probe = nn.Linear(self.feat_dim, self.num_classes).to(loop.device)
        opt = torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9)
        loop.model.eval()
        correct = total = 0
        for _ in range(self.epochs):
            for x, y in self.loader:
                x, y = x.to(loop.device), y.to(loop.device)
                with torch.no_grad():
                    feats = loop.model.encode(x)
                with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                    logits = probe(feats)
                    loss = F.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                correct += (logits.argmax(-1) == y).sum().item()
                total += y.numel()
        loop.model.train()
        loop.metrics["probe_acc"] = correct / max(total, 1)


class AmpOptimizer:
    """Optimizer with built-in loss scaling, for scripts that don't use the Loop.

    Usage: ``opt.zero_grad(); opt.backward(loss); opt.step()``.
    """

    def __init__(self, optimizer, max_grad_norm: Optional[float] = None, init_scale: float = 2.0 ** 16):
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _params(self):
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        if self.max_grad_norm:
            clip_grad_norm_(list(self._params()), self.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


class Loop:
    def __init__(self, model, optimizer, train_loader, callbacks: Iterable[Callback] = (),
                 precision: str = "16-mixed", accumulate: int = 1, max_epochs: int = 10,
                 device: str = "cuda"):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.callbacks: List[Callback] = list(callbacks)
        self.accumulate = accumulate
        self.max_epochs = max_epochs
        self.amp_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
        self.scaler = torch.cuda.amp.GradScaler(enabled=precision == "16-mixed")  # expect: AMP009
        self.global_step = 0
        self.epoch = 0
        self.metrics = {}

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _call(self, hook, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in batch.items()}

    def optimizer_step(self):
        self._call("on_before_optimizer_step", self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

    def run_batch(self, batch, batch_idx):
        with self._autocast():
            out = self.model.training_step(batch, batch_idx)
        loss = out["loss"] / self.accumulate
        self._call("on_before_backward", loss)
        self.scaler.scale(loss).backward()
        self._call("on_after_backward")
        if (batch_idx + 1) % self.accumulate == 0:
            self.optimizer_step()
        return loss.detach() * self.accumulate

    def fit(self):
        self._call("on_fit_start")
        self.model.train()
        for epoch in range(self.epoch, self.max_epochs):
            self.epoch = epoch
            for batch_idx, batch in enumerate(self.train_loader):
                batch = self._to_device(batch)
                self._call("on_train_batch_start", batch, batch_idx)
                loss = self.run_batch(batch, batch_idx)
                self._call("on_train_batch_end", loss, batch_idx)
                if self.global_step % 50 == 0:
                    log.info("epoch %d step %d loss %.4f %s", epoch, self.global_step, loss, self.metrics)
            self._call("on_train_epoch_end")


class MultiViewLoop(Loop):
    """Backpropagates each augmented view separately to keep activation memory flat."""

    def run_batch(self, batch, batch_idx):
        views = batch["views"]
        total = 0.0
        with self._autocast():
            for view in views:
                out = self.model.training_step({"image": view, "label": batch["label"]}, batch_idx)
                loss = out["loss"] / len(views)
                self._call("on_before_backward", loss)
                self.scaler.scale(loss).backward()  # expect: AMP008
                total += loss.item()
        self._call("on_after_backward")
        self.optimizer_step()
        return torch.tensor(total)


def finetune_head(model, loader, amp_dtype, epochs: int = 3, lr: float = 1e-3, device: str = "cuda"):
    """Quick head-only fine-tuning without the Loop machinery."""
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    opt = AmpOptimizer(torch.optim.AdamW(model.head.parameters(), lr=lr), max_grad_norm=1.0)
    model.train()
    for epoch in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=amp_dtype):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            opt.backward(loss)
            opt.step()
        log.info("head epoch %d loss %.4f", epoch, loss.item())
    return model


def build_callbacks(cfg, probe_loader=None) -> List[Callback]:
    callbacks: List[Callback] = [NonFiniteLossGuard(), LossScaleMonitor()]
    if cfg.get("clip"):
        callbacks.append(GradientClipping(cfg["clip"], cfg.get("clip_algorithm", "norm")))
    if cfg.get("ema"):
        callbacks.append(EMA(cfg["ema"]))
    if probe_loader is not None:
        callbacks.append(LinearProbe(probe_loader, cfg["feat_dim"], cfg["num_classes"]))
    callbacks.append(ModelCheckpoint(cfg.get("ckpt_dir", "checkpoints")))
    return callbacks


def make_loop(cfg, model, train_loader, probe_loader=None) -> Loop:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg.get("wd", 0.05))
    loop_cls = MultiViewLoop if cfg.get("multi_view") else Loop
    return loop_cls(
        model, optimizer, train_loader,
        callbacks=build_callbacks(cfg, probe_loader),
        precision=cfg.get("precision", "16-mixed"),
        accumulate=cfg.get("accumulate", 1),
        max_epochs=cfg.get("epochs", 100),
    )
