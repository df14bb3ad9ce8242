# Copyright (c) Facebook, Inc. and its affiliates.
# Project-specific trainers built on top of detectron2's SimpleTrainer.
import logging
import time
from typing import Optional

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from detectron2.engine import HookBase, SimpleTrainer
from detectron2.utils.events import get_event_storage

logger = logging.getLogger(__name__)

__all__ = ["AMPTrainer", "ClipGradAMPTrainer", "AccumAMPTrainer", "EMAAMPTrainer", "LossScaleLogger"]


def _build_grad_scaler(**kwargs):
    try:
        return torch.amp.GradScaler("cuda", **kwargs)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(**kwargs)


class AMPTrainer(SimpleTrainer):
    """
    Like :class:`SimpleTrainer`, but uses autocast and a GradScaler in the training loop.
    """

    def __init__(
        self,
        model,
        data_loader,
        optimizer,
        gather_metric_period=1,
        zero_grad_before_forward=False,
        grad_scaler=None,
        precision: torch.dtype = torch.float16,
        log_grad_scaler: bool = False,
    ):
        unsupported = "AMPTrainer does not support single-process multi-device training!"
        if isinstance(model, DistributedDataParallel):
            assert not (model.device_ids and len(model.device_ids) > 1), unsupported
        assert not isinstance(model, DataParallel), unsupported

        super().__init__(model, data_loader, optimizer, gather_metric_period, zero_grad_before_forward)

        if grad_scaler is None:
            grad_scaler = _build_grad_scaler()
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.log_grad_scaler = log_grad_scaler

    def _next_batch(self):
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        return data, time.perf_counter() - start

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        assert torch.cuda.is_available(), "[AMPTrainer] CUDA is required for mixed precision training!"

        data, data_time = self._next_batch()
        if self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        with torch.autocast(device_type="cuda", dtype=self.precision):
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())

        if not self.zero_grad_before_forward:
            self.optimizer.zero_grad()

        self.grad_scaler.scale(losses).backward()

        if self.log_grad_scaler:
            storage = get_event_storage()
            storage.put_scalar("[metric]grad_scaler", self.grad_scaler.get_scale())

        self.after_backward()
        self._write_metrics(loss_dict, data_time)

        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def state_dict(self):
        ret = super().state_dict()
        ret["grad_scaler"] = self.grad_scaler.state_dict()
        return ret

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class ClipGradAMPTrainer(AMPTrainer):
    """AMPTrainer with global gradient-norm clipping for transformer backbones."""

    def __init__(self, *args, max_norm: float = 1.0, norm_type: float = 2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_norm = max_norm
        self.norm_type = norm_type

    def run_step(self):
        data, data_time = self._next_batch()
        with torch.autocast(device_type="cuda", dtype=self.precision):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())

        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        total_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm, norm_type=self.norm_type)  # expect: AMP005
        loss_dict["grad_norm"] = total_norm
        self._write_metrics(loss_dict, data_time)

        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class AccumAMPTrainer(AMPTrainer):
    """Accumulates gradients over several loader batches before each optimizer step."""

    def __init__(self, *args, accum_steps: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.accum_steps = accum_steps

    def run_step(self):
        self.optimizer.zero_grad()
        total_time = 0.0
        for _ in range(self.accum_steps):
            data, data_time = self._next_batch()
            total_time += data_time
            with torch.autocast(device_type="cuda", dtype=self.precision):
                loss_dict = self.model(data)
                losses = sum(loss_dict.values()) / self.accum_steps
            losses = self.grad_scaler.scale(losses)
            losses.backward()

        self._write_metrics(loss_dict, total_time)
        self.optimizer.step()  # expect: AMP006


class EMAAMPTrainer(AMPTrainer):
    """Keeps an exponential moving average of the weights for evaluation."""

    def __init__(self, *args, model_ema: Optional[torch.nn.Module] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_ema = model_ema

    def run_step(self):
        data, data_time = self._next_batch()
        with torch.autocast(device_type="cuda", dtype=self.precision):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
            self.optimizer.zero_grad()
            self.grad_scaler.scale(losses).backward()  # expect: AMP008

        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)  # expect: AMP006
        if self.model_ema is not None:
            self.model_ema.update(self.model)


class LossScaleLogger(HookBase):
    """Logs the current loss scale every ``period`` iterations."""

    def __init__(self, period: int = 20):
        self._period = period

    def after_step(self):
        if (self.trainer.iter + 1) % self._period != 0:
            return
        scaler = getattr(self.trainer, "grad_scaler", None)
        if scaler is None or not scaler.is_enabled():
            return
        scale = scaler.get_scale()
        self.trainer.storage.put_scalar("loss_scale", scale, smoothing_hint=False)
        if scale < 1.0:
            logger.warning("loss scale dropped to %.3g at iter %d", scale, self.trainer.iter)
