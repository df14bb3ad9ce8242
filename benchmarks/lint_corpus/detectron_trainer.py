"""Simple and AMP trainers in the style of detectron2's engine/train_loop.py."""
import logging
import time

import numpy as np
import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

logger = logging.getLogger(__name__)


class TrainerBase:
    def __init__(self):
        self._hooks = []
        self.iter = 0
        self.start_iter = 0
        self.max_iter = 0

    def train(self, start_iter, max_iter):
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        for self.iter in range(start_iter, max_iter):
            self.before_step()
            self.run_step()
            self.after_step()

    def before_step(self):
        for h in self._hooks:
            h.before_step()

    def after_step(self):
        for h in self._hooks:
            h.after_step()

    def run_step(self):
        raise NotImplementedError


class SimpleTrainer(TrainerBase):
    def __init__(self, model, data_loader, optimizer, gather_metric_period=1):
        super().__init__()
        model.train()
        self.model = model
        self.data_loader = data_loader
        self._data_loader_iter_obj = None
        self.optimizer = optimizer
        self.gather_metric_period = gather_metric_period

    @property
    def _data_loader_iter(self):
        if self._data_loader_iter_obj is None:
            self._data_loader_iter_obj = iter(self.data_loader)
        return self._data_loader_iter_obj

    def run_step(self):
        assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        loss_dict = self.model(data)
        if isinstance(loss_dict, torch.Tensor):
            losses = loss_dict
            loss_dict = {"total_loss": loss_dict}
        else:
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        self._write_metrics(loss_dict, data_time)
        self.optimizer.step()

    def _write_metrics(self, loss_dict, data_time):
        metrics_dict = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        metrics_dict["data_time"] = data_time
        total_losses_reduced = sum(metrics_dict.values())
        if not np.isfinite(total_losses_reduced):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.iter}!")


class AMPTrainer(SimpleTrainer):
    """Like SimpleTrainer, but uses PyTorch's native automatic mixed precision."""

    def __init__(self, model, data_loader, optimizer, gather_metric_period=1, grad_scaler=None,
                 precision=torch.float16, log_grad_scaler=False):
        unsupported = "AMPTrainer does not support single-process multi-device training!"
        if isinstance(model, DistributedDataParallel):
            assert not (model.device_ids and len(model.device_ids) > 1), unsupported
        assert not isinstance(model, DataParallel), unsupported
        super().__init__(model, data_loader, optimizer, gather_metric_period)
        if grad_scaler is None:
            from torch.amp import GradScaler

            grad_scaler = GradScaler("cuda")
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.log_grad_scaler = log_grad_scaler

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        assert torch.cuda.is_available(), "[AMPTrainer] CUDA is required for AMP training!"
        from torch.amp import autocast

        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        with autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class ClippedAMPTrainer(AMPTrainer):
    """AMP trainer with full-model gradient clipping, as a project added it."""

    def __init__(self, model, data_loader, optimizer, clip_value=1.0):
        super().__init__(model, data_loader, optimizer)
        self.clip_value = clip_value
        self.scaler = torch.amp.GradScaler("cuda")

    def run_step(self):
        data = next(self._data_loader_iter)
        with torch.autocast("cuda", dtype=torch.float16):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.scaler.scale(losses).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_value)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
