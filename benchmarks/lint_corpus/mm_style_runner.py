"""A runner with optimizer wrappers in the style of mmengine (the wrapper does the scaling)."""
from contextlib import contextmanager

import torch
import torch.nn as nn


class OptimWrapper:
    def __init__(self, optimizer, clip_grad=None, accumulative_counts=1):
        self.optimizer = optimizer
        self.clip_grad_kwargs = clip_grad
        self._accumulative_counts = accumulative_counts
        self._inner_count = 0

    def update_params(self, loss, zero_kwargs=None):
        loss = loss / self._accumulative_counts
        self.backward(loss)
        if self.should_update():
            self.step()
            self.zero_grad(**(zero_kwargs or {}))

    def backward(self, loss, **kwargs):
        loss.backward(**kwargs)
        self._inner_count += 1

    def should_update(self):
        return self._inner_count % self._accumulative_counts == 0

    def step(self, **kwargs):
        if self.clip_grad_kwargs:
            self._clip_grad()
        self.optimizer.step(**kwargs)

    def zero_grad(self, **kwargs):
        self.optimizer.zero_grad(**kwargs)

    def _clip_grad(self):
        params = [p for pg in self.optimizer.param_groups for p in pg["params"] if p.grad is not None]
        if params:
            nn.utils.clip_grad_norm_(params, **self.clip_grad_kwargs)

    @contextmanager
    def optim_context(self, model):
        yield


class AmpOptimWrapper(OptimWrapper):
    def __init__(self, loss_scale="dynamic", dtype=None, **kwargs):
        super().__init__(**kwargs)
        if loss_scale == "dynamic":
            self.loss_scaler = torch.amp.GradScaler("cuda")
        else:
            self.loss_scaler = torch.amp.GradScaler("cuda", init_scale=loss_scale, growth_interval=10 ** 9)
        self.cast_dtype = dtype

    def backward(self, loss, **kwargs):
        self.loss_scaler.scale(loss).backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs):
        if self.clip_grad_kwargs:
            self.loss_scaler.unscale_(self.optimizer)
            self._clip_grad()
        self.loss_scaler.step(self.optimizer, **kwargs)
        self.loss_scaler.update(self._scale_update_param)

    @contextmanager
    def optim_context(self, model):
        with torch.autocast("cuda", dtype=self.cast_dtype):
            yield


class Runner:
    def __init__(self, model, optim_wrapper, train_dataloader, max_iters):
        self.model = model
        self.optim_wrapper = optim_wrapper
        self.train_dataloader = train_dataloader
        self.max_iters = max_iters

    def train(self):
        self.model.train()
        for i, data in enumerate(self.train_dataloader):
            with self.optim_wrapper.optim_context(self.model):
                data = self.model.data_preprocessor(data, True)
                losses = self.model(**data, mode="loss")
            parsed_losses, log_vars = self.parse_losses(losses)
            self.optim_wrapper.update_params(parsed_losses)
            if i >= self.max_iters:
                break

    @staticmethod
    def parse_losses(losses):
        log_vars = []
        for loss_name, loss_value in losses.items():
            if isinstance(loss_value, torch.Tensor):
                log_vars.append([loss_name, loss_value.mean()])
            elif isinstance(loss_value, list):
                log_vars.append([loss_name, sum(_loss.mean() for _loss in loss_value)])
        loss = sum(value for key, value in log_vars if "loss" in key)
        return loss, dict(log_vars)
