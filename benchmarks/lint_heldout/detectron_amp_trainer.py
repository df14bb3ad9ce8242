"""Trainers in the style of detectron2's engine/train_loop.py, with shared gradient clipping."""
import copy
import logging
import time
import weakref
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

logger = logging.getLogger(__name__)


class HookBase:
    trainer = None

    def before_train(self): pass
    def after_train(self): pass
    def before_step(self): pass
    def after_step(self): pass


class TrainerBase:
    def __init__(self):
        self._hooks: List[HookBase] = []
        self.iter = 0
        self.start_iter = 0
        self.max_iter = 0

    def register_hooks(self, hooks: List[Optional[HookBase]]):
        for h in hooks:
            if h is not None:
                h.trainer = weakref.proxy(self)
                self._hooks.append(h)

    def train(self, start_iter: int, max_iter: int):
        logger.info("Starting training from iteration %d", start_iter)
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        for h in self._hooks:
            h.before_train()
        for self.iter in range(start_iter, max_iter):
            for h in self._hooks:
                h.before_step()
            self.run_step()
            for h in self._hooks:
                h.after_step()
        for h in self._hooks:
            h.after_train()

    def run_step(self):
        raise NotImplementedError


class GradientClipMixin:
    clip_max_norm: float = 0.0
    clip_norm_type: float = 2.0

    def _params_with_grad(self):
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _clip_gradients(self):
        params = self._params_with_grad()
        if not params:
            return None
        return torch.nn.utils.clip_grad_norm_(params, self.clip_max_norm, norm_type=self.clip_norm_type)


class SimpleTrainer(GradientClipMixin, TrainerBase):
    def __init__(self, model, data_loader, optimizer, clip_max_norm=0.0):
        super().__init__()
        model.train()
        self.model = model
        self.data_loader = data_loader
        self._data_loader_iter = iter(data_loader)
        self.optimizer = optimizer
        self.clip_max_norm = clip_max_norm

    def run_step(self):
        assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        loss_dict = self.model(data)
        losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        if self.clip_max_norm > 0:
            self._clip_gradients()
        self.optimizer.step()
        self._write_metrics(loss_dict, data_time)

    def _write_metrics(self, loss_dict: Dict[str, torch.Tensor], data_time: float):
        metrics = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        total = sum(metrics.values())
        if not np.isfinite(total):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.iter}!\nloss_dict = {metrics}")
        if self.iter % 20 == 0:
            logger.info("iter %d: total_loss %.4f data_time %.4f", self.iter, total, data_time)


class AMPTrainer(SimpleTrainer):
    def __init__(self, model, data_loader, optimizer, grad_scaler=None, precision=torch.float16, clip_max_norm=0.0):
        unsupported = "AMPTrainer does not support single-process multi-device training!"
        if isinstance(model, DistributedDataParallel):
            assert not (model.device_ids and len(model.device_ids) > 1), unsupported
        assert not isinstance(model, DataParallel), unsupported
        super().__init__(model, data_loader, optimizer, clip_max_norm=clip_max_norm)
        if grad_scaler is None:
            from torch.cuda.amp import GradScaler

            grad_scaler = GradScaler()  # expect: AMP009
        self.grad_scaler = grad_scaler
        self.precision = precision

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        with torch.autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        if self.clip_max_norm > 0:
            self._clip_gradients()  # expect: AMP005
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self._write_metrics(loss_dict, data_time)

    def state_dict(self):
        return {"iteration": self.iter, "grad_scaler": self.grad_scaler.state_dict()}


class AMPGradAccumTrainer(AMPTrainer):
    """AMP trainer that accumulates gradients over ``accum_iters`` batches per update."""

    def __init__(self, *args, accum_iters=4, **kwargs):
        super().__init__(*args, **kwargs)
        self.accum_iters = accum_iters

    def run_step(self):
        data_time = 0.0
        with torch.autocast("cuda", dtype=self.precision):
            for _ in range(self.accum_iters):
                start = time.perf_counter()
                data = next(self._data_loader_iter)
                data_time += time.perf_counter() - start
                loss_dict = self.model(data)
                losses = sum(loss_dict.values()) / self.accum_iters
                self.grad_scaler.scale(losses).backward()  # expect: AMP008
        self.grad_scaler.unscale_(self.optimizer)
        if self.clip_max_norm > 0:
            self._clip_gradients()
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self.optimizer.zero_grad()
        self._write_metrics(loss_dict, data_time)


class EvalHook(HookBase):
    def __init__(self, period, eval_function):
        self._period = period
        self._func = eval_function

    def _do_eval(self):
        model = copy.deepcopy(self.trainer.model).half().eval()
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
            results = self._func(model)
        logger.info("Evaluation results at iter %d: %s", self.trainer.iter, results)

    def after_step(self):
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0 and next_iter != self.trainer.max_iter:
            self._do_eval()

    def after_train(self):
        self._do_eval()
