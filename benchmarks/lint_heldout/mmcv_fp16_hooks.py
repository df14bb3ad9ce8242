# Copyright (c) OpenMMLab. All rights reserved.
"""Optimizer hooks for the runner, including AMP variants.

These replace the old apex / ``torch.cuda.amp.GradScaler`` based hooks with ``torch.amp``.
"""
import logging
from typing import Optional

import torch
from torch.nn.utils import clip_grad

from mmcv.runner import HOOKS, Hook

logger = logging.getLogger(__name__)


@HOOKS.register_module()
class OptimizerHook(Hook):
    def __init__(self, grad_clip: Optional[dict] = None, detect_anomalous_params: bool = False):
        self.grad_clip = grad_clip
        self.detect_anomalous_params = detect_anomalous_params

    def clip_grads(self, params):
        params = list(filter(lambda p: p.requires_grad and p.grad is not None, params))
        if len(params) > 0:
            return clip_grad.clip_grad_norm_(params, **self.grad_clip)

    def after_train_iter(self, runner):
        runner.optimizer.zero_grad()
        if self.detect_anomalous_params:
            self.detect_anomalous_parameters(runner.outputs["loss"], runner)
        runner.outputs["loss"].backward()
        if self.grad_clip is not None:
            grad_norm = self.clip_grads(runner.model.parameters())
            if grad_norm is not None:
                runner.log_buffer.update({"grad_norm": float(grad_norm)}, runner.outputs["num_samples"])
        runner.optimizer.step()

    def detect_anomalous_parameters(self, loss, runner):
        parameters_in_graph = set()
        visited = set()

        def traverse(grad_fn):
            if grad_fn is None or grad_fn in visited:
                return
            visited.add(grad_fn)
            if hasattr(grad_fn, "variable"):
                parameters_in_graph.add(grad_fn.variable)
            for parent, _ in grad_fn.next_functions:
                traverse(parent)

        traverse(loss.grad_fn)
        for n, p in runner.model.named_parameters():
            if p not in parameters_in_graph and p.requires_grad:
                runner.logger.log(level=logging.ERROR, msg=f"{n} with shape {p.size()} is not in the computational graph")


@HOOKS.register_module()
class GradientCumulativeOptimizerHook(OptimizerHook):
    def __init__(self, cumulative_iters: int = 1, **kwargs):
        super().__init__(**kwargs)
        assert isinstance(cumulative_iters, int) and cumulative_iters > 0
        self.cumulative_iters = cumulative_iters
        self.divisible_iters = 0
        self.remainder_iters = 0
        self.initialized = False

    def _init(self, runner):
        residual_iters = runner.max_iters - runner.iter
        self.divisible_iters = residual_iters // self.cumulative_iters * self.cumulative_iters
        self.remainder_iters = residual_iters - self.divisible_iters
        self.initialized = True

    def _loss_factor(self, runner):
        return self.cumulative_iters if runner.iter < self.divisible_iters else self.remainder_iters

    def after_train_iter(self, runner):
        if not self.initialized:
            self._init(runner)
        loss = runner.outputs["loss"] / self._loss_factor(runner)
        loss.backward()
        if self.every_n_iters(runner, self.cumulative_iters) or self.is_last_iter(runner):
            if self.grad_clip is not None:
                grad_norm = self.clip_grads(runner.model.parameters())
                if grad_norm is not None:
                    runner.log_buffer.update({"grad_norm": float(grad_norm)}, runner.outputs["num_samples"])
            runner.optimizer.step()
            runner.optimizer.zero_grad()


@HOOKS.register_module()
class Fp16OptimizerHook(OptimizerHook):
    """Optimizer hook for mixed-precision training with ``torch.amp.GradScaler``.

    Args:
        loss_scale (float | str | dict): "dynamic", a fixed initial scale, or GradScaler kwargs.
    """

    def __init__(self, grad_clip=None, coalesce=True, bucket_size_mb=-1, loss_scale=512.0, distributed=True):
        self.grad_clip = grad_clip
        self.coalesce = coalesce
        self.bucket_size_mb = bucket_size_mb
        self.distributed = distributed
        self._scale_update_param = None
        if loss_scale == "dynamic":
            self.loss_scaler = torch.amp.GradScaler("cuda")
        elif isinstance(loss_scale, float):
            self._scale_update_param = loss_scale
            self.loss_scaler = torch.amp.GradScaler("cuda", init_scale=loss_scale)
        elif isinstance(loss_scale, dict):
            self.loss_scaler = torch.amp.GradScaler("cuda", **loss_scale)
        else:
            raise ValueError(f'loss_scale must be of type float, dict, or "dynamic", got {loss_scale}')

    def before_run(self, runner):
        if "fp16" in runner.meta and "loss_scaler" in runner.meta["fp16"]:
            self.loss_scaler.load_state_dict(runner.meta["fp16"]["loss_scaler"])

    def after_train_iter(self, runner):
        runner.model.zero_grad()
        runner.optimizer.zero_grad()
        self.loss_scaler.scale(runner.outputs["loss"]).backward()
        if self.grad_clip is not None:
            grad_norm = self.clip_grads(runner.model.parameters())  # expect: AMP005
            if grad_norm is not None:
                runner.log_buffer.update({"grad_norm": float(grad_norm)}, runner.outputs["num_samples"])
        self.loss_scaler.step(runner.optimizer)
        self.loss_scaler.update(self._scale_update_param)
        runner.meta.setdefault("fp16", {})["loss_scaler"] = self.loss_scaler.state_dict()


@HOOKS.register_module()
class GradientCumulativeFp16OptimizerHook(GradientCumulativeOptimizerHook, Fp16OptimizerHook):
    """Fp16 optimizer hook with gradient accumulation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def after_train_iter(self, runner):
        if not self.initialized:
            self._init(runner)
        loss = runner.outputs["loss"] / self._loss_factor(runner)
        self.loss_scaler.scale(loss).backward()
        if self.every_n_iters(runner, self.cumulative_iters) or self.is_last_iter(runner):
            self.loss_scaler.unscale_(runner.optimizer)
            if self.grad_clip is not None:
                grad_norm = self.clip_grads(runner.model.parameters())
                if grad_norm is not None:
                    runner.log_buffer.update({"grad_norm": float(grad_norm)}, runner.outputs["num_samples"])
            self.loss_scaler.step(runner.optimizer)  # expect: AMP006
            runner.meta.setdefault("fp16", {})["loss_scaler"] = self.loss_scaler.state_dict()
            runner.model.zero_grad()
            runner.optimizer.zero_grad()
