"""ViT fine-tuning engine split into mixins (backward, clipping, stepping live in different methods)."""
import math
import sys
from typing import Iterable, Optional

import torch
import torch.nn as nn
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV2, NativeScaler, accuracy


class ClipMixin:
    max_norm: Optional[float] = None

    def clip(self):
        if self.max_norm:
            return nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        return None


class AmpEngine(ClipMixin):
    def __init__(self, model: nn.Module, optimizer, max_norm: float = 1.0, accum: int = 1):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.accum = accum
        self.scaler = torch.amp.GradScaler("cuda")
        self.criterion = SoftTargetCrossEntropy()
        self.mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)

    def backward(self, loss: torch.Tensor) -> None:
        torch.autograd.backward(self.scaler.scale(loss / self.accum))

    def optimizer_step(self) -> Optional[torch.Tensor]:
        grad_norm = self.clip()  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_one_epoch(self, loader: Iterable, epoch: int) -> float:
        self.model.train()
        total = 0.0
        for it, (samples, targets) in enumerate(loader):
            samples, targets = samples.cuda(non_blocking=True), targets.cuda(non_blocking=True)
            samples, targets = self.mixup(samples, targets)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.criterion(self.model(samples), targets)
            if not math.isfinite(loss.item()):
                print(f"Loss is {loss.item()}, stopping training")
                sys.exit(1)
            self.backward(loss)
            if (it + 1) % self.accum == 0:
                self.optimizer_step()
            total += loss.item()
        return total / (it + 1)


class AmpEngineFixed(AmpEngine):
    def optimizer_step(self) -> Optional[torch.Tensor]:
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


def deit_train_one_epoch(model, criterion, loader, optimizer, loss_scaler: NativeScaler, model_ema: ModelEmaV2,
                         max_norm: float = 0.0, mixup_fn=None):
    """DeiT-style loop: timm's NativeScaler does scale/unscale/clip/step/update in one call."""
    model.train()
    for samples, targets in loader:
        samples, targets = samples.cuda(non_blocking=True), targets.cuda(non_blocking=True)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)
        with torch.amp.autocast("cuda"):
            outputs = model(samples)
            loss = criterion(outputs, targets)
        optimizer.zero_grad()
        is_second_order = hasattr(optimizer, "is_second_order") and optimizer.is_second_order
        loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters(), create_graph=is_second_order)
        torch.cuda.synchronize()
        if model_ema is not None:
            model_ema.update(model)


@torch.no_grad()
def evaluate(loader, model):
    criterion = torch.nn.CrossEntropyLoss()
    model.eval()
    top1 = []
    for images, target in loader:
        with torch.amp.autocast("cuda"):
            output = model(images.cuda())
            loss = criterion(output, target.cuda())
        top1.append(accuracy(output, target.cuda(), topk=(1,))[0])
    return sum(top1) / len(top1), loss.item()


class ManualAccumulation:
    """Gradient accumulation written by hand for a 7B model on one GPU."""

    def __init__(self, model, optimizer, accum_steps=16):
        self.model, self.optimizer, self.accum_steps = model, optimizer, accum_steps
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)

    def run(self, loader):
        for i, batch in enumerate(loader):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.model(**batch).loss / self.accum_steps
            self.scaler.scale(loss).backward()
            if (i + 1) % self.accum_steps:
                continue
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.step()  # expect: AMP006
            self.optimizer.zero_grad(set_to_none=True)
