# -*- coding: utf-8 -*-
# Copyright (c) Facebook, Inc. and its affiliates.
"""
Hook-based trainers used by the detection and re-identification projects.

``SimpleTrainer`` and ``AMPTrainer`` follow detectron2.engine.train_loop; the
subclasses add global gradient clipping, gradient accumulation and the
re-id objective (ID cross-entropy + batch-hard triplet).
"""
import logging
import time
import weakref
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

import detectron2.utils.comm as comm
from detectron2.utils.events import EventStorage, get_event_storage

__all__ = ["HookBase", "TrainerBase", "SimpleTrainer", "AMPTrainer", "ClipGradAMPTrainer", "ReIDTrainer"]

logger = logging.getLogger(__name__)


class HookBase:
    trainer: "TrainerBase" = None

    def before_train(self):
        pass

    def after_train(self):
        pass

    def before_step(self):
        pass

    def after_backward(self):
        pass

    def after_step(self):
        pass

    def state_dict(self):
        return {}


class TrainerBase:
    def __init__(self) -> None:
        self._hooks: List[HookBase] = []
        self.iter: int = 0
        self.start_iter: int = 0
        self.max_iter: int
        self.storage: EventStorage

    def register_hooks(self, hooks: List[Optional[HookBase]]) -> None:
        hooks = [h for h in hooks if h is not None]
        for h in hooks:
            assert isinstance(h, HookBase)
            # weak reference to avoid a circular reference between trainer and hook
            h.trainer = weakref.proxy(self)
        self._hooks.extend(hooks)

    def train(self, start_iter: int, max_iter: int):
        logger.info("Starting training from iteration {}".format(start_iter))
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        with EventStorage(start_iter) as self.storage:
            try:
                self.before_train()
                for self.iter in range(start_iter, max_iter):
                    self.before_step()
                    self.run_step()
                    self.after_step()
                self.iter += 1
            except Exception:
                logger.exception("Exception during training:")
                raise
            finally:
                self.after_train()

    def before_train(self):
        for h in self._hooks:
            h.before_train()

    def after_train(self):
        self.storage.iter = self.iter
        for h in self._hooks:
            h.after_train()

    def before_step(self):
        self.storage.iter = self.iter
        for h in self._hooks:
            h.before_step()

    def after_backward(self):
        for h in self._hooks:
            h.after_backward()

    def after_step(self):
        for h in self._hooks:
            h.after_step()

    def run_step(self):
        raise NotImplementedError

    def state_dict(self):
        ret = {"iteration": self.iter}
        hooks_state = {}
        for h in self._hooks:
            sd = h.state_dict()
            if sd:
                hooks_state[type(h).__qualname__] = sd
        if hooks_state:
            ret["hooks"] = hooks_state
        return ret


class SimpleTrainer(TrainerBase):
    def __init__(self, model, data_loader, optimizer, gather_metric_period=1, zero_grad_before_forward=False):
        super().__init__()
        model.train()
        self.model = model
        self.data_loader = data_loader
        self._data_loader_iter_obj = None
        self.optimizer = optimizer
        self.gather_metric_period = gather_metric_period
        self.zero_grad_before_forward = zero_grad_before_forward

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
        if self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        loss_dict = self.model(data)
        if isinstance(loss_dict, torch.Tensor):
            losses = loss_dict
            loss_dict = {"total_loss": loss_dict}
        else:
            losses = sum(loss_dict.values())
        if not self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        losses.backward()
        self.after_backward()
        self._write_metrics(loss_dict, data_time)
        self.optimizer.step()

    def _write_metrics(self, loss_dict: Dict[str, torch.Tensor], data_time: float, prefix: str = "") -> None:
        if (self.iter + 1) % self.gather_metric_period == 0:
            SimpleTrainer.write_metrics(loss_dict, data_time, self.iter, prefix)

    @staticmethod
    def write_metrics(loss_dict, data_time, cur_iter, prefix=""):
        metrics_dict = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        metrics_dict["data_time"] = data_time
        all_metrics_dict = comm.gather(metrics_dict)
        if comm.is_main_process():
            storage = get_event_storage()
            data_time = np.max([x.pop("data_time") for x in all_metrics_dict])
            storage.put_scalar("data_time", data_time, cur_iter=cur_iter)
            metrics_dict = {k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0].keys()}
            total_losses_reduced = sum(metrics_dict.values())
            if not np.isfinite(total_losses_reduced):
                raise FloatingPointError(
                    f"Loss became infinite or NaN at iteration={cur_iter}!\nloss_dict = {metrics_dict}"
                )
            storage.put_scalar("{}total_loss".format(prefix), total_losses_reduced, cur_iter=cur_iter)
            if len(metrics_dict) > 1:
                storage.put_scalars(cur_iter=cur_iter, **metrics_dict)


class AMPTrainer(SimpleTrainer):
    """Like SimpleTrainer, but uses autocast and a GradScaler."""

    def __init__(self, model, data_loader, optimizer, gather_metric_period=1, zero_grad_before_forward=False,
                 grad_scaler=None, precision: torch.dtype = torch.float16, log_grad_scaler: bool = False):
        unsupported = "AMPTrainer does not support single-process multi-device training!"
        if isinstance(model, DistributedDataParallel):
            assert not (model.device_ids and len(model.device_ids) > 1), unsupported
        assert not isinstance(model, DataParallel), unsupported
        super().__init__(model, data_loader, optimizer, gather_metric_period, zero_grad_before_forward)
        if grad_scaler is None:
            grad_scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.log_grad_scaler = log_grad_scaler

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        assert torch.cuda.is_available(), "[AMPTrainer] CUDA is required for AMP training!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        if self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        with torch.autocast("cuda", dtype=self.precision):
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
            get_event_storage().put_scalar("[metric]grad_scaler", self.grad_scaler.get_scale())
        self.after_backward()
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def state_dict(self):
        ret = super().state_dict()
        ret["grad_scaler"] = self.grad_scaler.state_dict()
        return ret


class ClipGradAMPTrainer(AMPTrainer):
    """AMPTrainer with one global clip over all parameters (SOLVER.CLIP_GRADIENTS.CLIP_TYPE = "full_model")."""

    def __init__(self, *args, clip_value: float = 1.0, clip_type: str = "norm", **kwargs):
        super().__init__(*args, **kwargs)
        self.clip_value = clip_value
        self.clip_type = clip_type

    def _clip_grads(self):
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        if len(params) == 0:
            return None
        if self.clip_type == "value":
            torch.nn.utils.clip_grad_value_(params, self.clip_value)
            return None
        return torch.nn.utils.clip_grad_norm_(params, self.clip_value, norm_type=2.0)

    def run_step(self):
        assert self.model.training, "[ClipGradAMPTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        with torch.autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        grad_norm = self._clip_grads()  # expect: AMP005
        self.after_backward()
        if grad_norm is not None:
            get_event_storage().put_scalar("grad_norm", grad_norm.item(), smoothing_hint=False)
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class GradAccumAMPTrainer(AMPTrainer):
    """Accumulates ``accum_steps`` micro-batches per optimizer step (large-batch configs on 16GB cards)."""

    def __init__(self, *args, accum_steps: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.accum_steps = accum_steps

    def run_step(self):
        assert self.model.training, "[GradAccumAMPTrainer] model was changed to eval mode!"
        self.optimizer.zero_grad()
        loss_dict_acc: Dict[str, torch.Tensor] = {}
        data_time = 0.0
        for _ in range(self.accum_steps):
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time += time.perf_counter() - start
            with torch.autocast("cuda", dtype=self.precision):
                loss_dict = self.model(data)
                losses = sum(loss_dict.values()) / self.accum_steps
                self.grad_scaler.scale(losses).backward()  # expect: AMP008
            for k, v in loss_dict.items():
                loss_dict_acc[k] = loss_dict_acc.get(k, 0.0) + v.detach() / self.accum_steps
        self.after_backward()
        self._write_metrics(loss_dict_acc, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


def _create_gradient_clipper(clip_type: str, clip_value: float, norm_type: float = 2.0):
    def clip_grad_norm(p):
        torch.nn.utils.clip_grad_norm_(p, clip_value, norm_type)

    def clip_grad_value(p):
        torch.nn.utils.clip_grad_value_(p, clip_value)

    return {"value": clip_grad_value, "norm": clip_grad_norm}[clip_type]


def maybe_add_gradient_clipping(cfg, optimizer):
    """Per-parameter clipping done inside ``optimizer.step``; GradScaler.step unscales before calling it."""
    if not cfg.SOLVER.CLIP_GRADIENTS.ENABLED:
        return optimizer
    clipper = _create_gradient_clipper(cfg.SOLVER.CLIP_GRADIENTS.CLIP_TYPE, cfg.SOLVER.CLIP_GRADIENTS.CLIP_VALUE)

    def optimizer_wgc_step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                clipper(p)
        super(type(self), self).step(closure)

    optimizer_type = type(optimizer)
    new_type = type(optimizer_type.__name__ + "WithGradientClip", (optimizer_type,), {"step": optimizer_wgc_step})
    optimizer.__class__ = new_type
    return optimizer


class TripletLoss(nn.Module):
    """Batch-hard triplet loss (Hermans et al., 2017)."""

    def __init__(self, margin: Optional[float] = 0.3):
        super().__init__()
        self.margin = margin
        self.ranking_loss = nn.MarginRankingLoss(margin=margin) if margin is not None else nn.SoftMarginLoss()

    def forward(self, embeddings, targets):
        dist = torch.cdist(embeddings, embeddings, p=2)
        is_pos = targets.unsqueeze(0).eq(targets.unsqueeze(1))
        dist_ap = dist.masked_fill(~is_pos, float("-inf")).max(dim=1).values
        dist_an = dist.masked_fill(is_pos, float("inf")).min(dim=1).values
        y = torch.ones_like(dist_an)
        if self.margin is not None:
            return self.ranking_loss(dist_an, dist_ap, y)
        return self.ranking_loss(dist_an - dist_ap, y)


class ReIDTrainer(AMPTrainer):
    """Person re-id: the model returns (bnneck features, class logits) in training mode."""

    def __init__(self, model, data_loader, optimizer, margin: float = 0.3, label_smoothing: float = 0.1, **kwargs):
        super().__init__(model, data_loader, optimizer, grad_scaler=torch.amp.GradScaler("cuda"), **kwargs)
        self.id_loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.triplet = TripletLoss(margin=margin)

    def run_step(self):
        assert self.model.training, "[ReIDTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        images = data["images"].cuda(non_blocking=True)
        targets = data["targets"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            feats, logits = self.model(images)
            loss_id = self.id_loss(logits, targets)
        loss_tri = self.triplet(feats, targets)  # expect: AMP002
        losses = loss_id + loss_tri
        loss_dict = {"loss_id": loss_id, "loss_triplet": loss_tri}
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self.after_backward()
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class LossScaleLogger(HookBase):
    def __init__(self, period: int = 20):
        self._period = period

    def after_step(self):
        scaler = getattr(self.trainer, "grad_scaler", None)
        if scaler is not None and (self.trainer.iter + 1) % self._period == 0:
            self.trainer.storage.put_scalar("loss_scale", scaler.get_scale(), smoothing_hint=False)


class BestMetricHook(HookBase):
    """Runs ``eval_function`` every ``period`` iterations and keeps the best value seen."""

    def __init__(self, period: int, eval_function, metric_name: str = "bbox/AP"):
        self._period = period
        self._func = eval_function
        self._metric_name = metric_name
        self._best_value = -1e9

    def after_step(self):
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0 and next_iter != self.trainer.max_iter:
            results = self._func()
            comm.synchronize()
            value = results.get(self._metric_name, -1e9)
            if value > self._best_value:
                self._best_value = value
                logger.info("New best %s: %.4f at iteration %d", self._metric_name, value, next_iter)

    def state_dict(self):
        return {"best_value": self._best_value}
