"""Trainer loop with hooks, modelled on detectron2's ``engine/train_loop.py``.

``SimpleTrainer`` runs fp32; ``AMPTrainer`` runs the forward under autocast and
owns a GradScaler (older releases built it with torch.cuda.amp.GradScaler).
Project-specific trainers below add clipping, learned loss weights, a
benchmark mode and a bf16 mode.
"""
import itertools
import time
import weakref
from typing import List, Optional

import numpy as np
import torch
import torch.nn as nn
from detectron2.utils.events import EventStorage


def _make_grad_scaler(**kwargs):
    try:
        return torch.amp.GradScaler("cuda", **kwargs)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(**kwargs)


def maybe_add_gradient_clipping(optimizer_cls, clip_value: Optional[float]):
    """Return an optimizer class whose ``step`` clips first (GradScaler.step unscales before calling it)."""
    if clip_value is None:
        return optimizer_cls

    class ClippingOptimizer(optimizer_cls):
        def step(self, closure=None):
            all_params = itertools.chain(*[g["params"] for g in self.param_groups])
            torch.nn.utils.clip_grad_norm_(all_params, clip_value)
            return super().step(closure)

    return ClippingOptimizer


class HookBase:
    trainer = None

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


class TrainerBase:
    def __init__(self):
        self._hooks: List[HookBase] = []
        self.iter = 0
        self.start_iter = 0
        self.storage = None

    def register_hooks(self, hooks):
        for h in hooks:
            h.trainer = weakref.proxy(self)
            self._hooks.append(h)

    def train(self, start_iter: int, max_iter: int):
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        with EventStorage(start_iter) as self.storage:
            try:
                for h in self._hooks:
                    h.before_train()
                for self.iter in range(start_iter, max_iter):
                    for h in self._hooks:
                        h.before_step()
                    self.run_step()
                    for h in self._hooks:
                        h.after_step()
                self.iter += 1
            finally:
                for h in self._hooks:
                    h.after_train()

    def after_backward(self):
        for h in self._hooks:
            h.after_backward()

    def run_step(self):
        raise NotImplementedError


class SimpleTrainer(TrainerBase):
    def __init__(self, model, data_loader, optimizer, zero_grad_before_forward=False):
        super().__init__()
        model.train()
        self.model = model
        self.data_loader = data_loader
        self._data_loader_iter = iter(data_loader)
        self.optimizer = optimizer
        self.zero_grad_before_forward = zero_grad_before_forward

    def run_step(self):
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

    def _write_metrics(self, loss_dict, data_time, prefix=""):
        metrics = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        total = sum(metrics.values())
        if not np.isfinite(total):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.iter}! loss_dict = {metrics}")
        self.storage.put_scalar(prefix + "total_loss", total)
        self.storage.put_scalar("data_time", data_time)


class AMPTrainer(SimpleTrainer):
    def __init__(self, model, data_loader, optimizer, zero_grad_before_forward=False, grad_scaler=None,
                 precision: torch.dtype = torch.float16, log_grad_scaler=False):
        super().__init__(model, data_loader, optimizer, zero_grad_before_forward)
        if grad_scaler is None:
            grad_scaler = _make_grad_scaler()
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.log_grad_scaler = log_grad_scaler

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
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
            self.storage.put_scalar("[metric]grad_scaler", self.grad_scaler.get_scale())
        self.after_backward()
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class ClippedAMPTrainer(AMPTrainer):
    """Clips the full-model gradient norm every iteration (for the ViT backbones)."""

    def __init__(self, *args, clip_norm=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.clip_norm = clip_norm

    def run_step(self):
        data = next(self._data_loader_iter)
        with torch.autocast("cuda", dtype=torch.float16):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        total_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)  # expect: AMP005
        self.after_backward()
        self.storage.put_scalar("grad_norm", total_norm.item())
        self._write_metrics(loss_dict, 0.0)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class UncertaintyWeightedAMPTrainer(AMPTrainer):
    """Kendall et al. task weighting: one learned log-variance per loss term."""

    def __init__(self, model, data_loader, optimizer, loss_names, weight_lr=1e-3, **kwargs):
        super().__init__(model, data_loader, optimizer, **kwargs)
        self.log_vars = nn.ParameterDict({k: nn.Parameter(torch.zeros((), device="cuda")) for k in loss_names})
        self.weight_optimizer = torch.optim.SGD(self.log_vars.parameters(), lr=weight_lr)

    def run_step(self):
        data = next(self._data_loader_iter)
        with torch.autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
        losses = sum(torch.exp(-self.log_vars[k]) * v + self.log_vars[k] for k, v in loss_dict.items())
        self.optimizer.zero_grad()
        self.weight_optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self.after_backward()
        self._write_metrics(loss_dict, 0.0)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self.weight_optimizer.step()  # expect: AMP006
        for k, v in self.log_vars.items():
            self.storage.put_scalar(f"log_var/{k}", v.item())


class BenchmarkAMPTrainer(AMPTrainer):
    """Used by tools/benchmark.py to time fwd+bwd; no metrics, no hooks."""

    def run_step(self):
        data = next(self._data_loader_iter)
        with torch.autocast("cuda", dtype=torch.float16):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
            self.optimizer.zero_grad()
            self.grad_scaler.scale(losses).backward()  # expect: AMP008
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class BF16Trainer(SimpleTrainer):
    """For A100/H100 runs."""

    def __init__(self, model, data_loader, optimizer, **kwargs):
        super().__init__(model, data_loader, optimizer, **kwargs)
        self.grad_scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    def run_step(self):
        data = next(self._data_loader_iter)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self.after_backward()
        self._write_metrics(loss_dict, 0.0)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


class PlainBF16Trainer(SimpleTrainer):
    def run_step(self):
        data = next(self._data_loader_iter)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        self.after_backward()
        self._write_metrics(loss_dict, 0.0)
        self.optimizer.step()


class LRSchedulerHook(HookBase):
    def __init__(self, scheduler):
        self._scheduler = scheduler

    def after_step(self):
        self.trainer.storage.put_scalar("lr", self.trainer.optimizer.param_groups[0]["lr"])
        self._scheduler.step()


class EMAHook(HookBase):
    def __init__(self, model, decay=0.9998):
        self.decay = decay
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items() if v.dtype.is_floating_point}

    @torch.no_grad()
    def after_step(self):
        for k, v in self.trainer.model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].lerp_(v.float(), 1.0 - self.decay)


class PeriodicCheckpointer(HookBase):
    def __init__(self, period, path):
        self.period = period
        self.path = path
        self.best_metric = -1e9

    def after_step(self):
        if (self.trainer.iter + 1) % self.period == 0:
            state = {k: v.half() for k, v in self.trainer.model.state_dict().items()}
            torch.save({"model": state, "iter": self.trainer.iter}, f"{self.path}/model_{self.trainer.iter:07d}.pth")


class EvalHook(HookBase):
    def __init__(self, period, eval_function):
        self._period = period
        self._func = eval_function

    def after_step(self):
        if (self.trainer.iter + 1) % self._period == 0:
            self.trainer.model.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                results = self._func(self.trainer.model)
            self.trainer.model.train()
            for k, v in results.items():
                self.trainer.storage.put_scalar(f"eval/{k}", v)


def build_trainer(cfg, model, data_loader):
    opt_cls = maybe_add_gradient_clipping(torch.optim.AdamW, cfg["solver"].get("clip_value"))
    optimizer = opt_cls(model.parameters(), lr=cfg["solver"]["base_lr"], weight_decay=cfg["solver"]["weight_decay"])
    kind = cfg["train"].get("trainer", "amp")
    if kind == "amp":
        trainer = AMPTrainer(model, data_loader, optimizer, log_grad_scaler=True)
    elif kind == "clipped":
        trainer = ClippedAMPTrainer(model, data_loader, optimizer, clip_norm=cfg["solver"]["clip_value"])
    elif kind == "uncertainty":
        trainer = UncertaintyWeightedAMPTrainer(model, data_loader, optimizer, loss_names=cfg["train"]["loss_names"])
    elif kind == "bench":
        trainer = BenchmarkAMPTrainer(model, data_loader, optimizer)
    elif kind == "bf16":
        trainer = PlainBF16Trainer(model, data_loader, optimizer) if cfg["train"].get("no_scaler") else BF16Trainer(model, data_loader, optimizer)
    else:
        trainer = SimpleTrainer(model, data_loader, optimizer)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg["solver"]["steps"], gamma=0.1)
    trainer.register_hooks([
        LRSchedulerHook(scheduler),
        EMAHook(model),
        PeriodicCheckpointer(cfg["train"]["checkpoint_period"], cfg["train"]["output_dir"]),
        EvalHook(cfg["test"]["eval_period"], cfg["test"]["evaluator"]),
    ])
    return trainer


@torch.inference_mode()
def benchmark_inference(model, data_loader, num_iter=200):
    model = model.half().eval()
    times = []
    for idx, data in zip(range(num_iter), data_loader):
        start = time.perf_counter()
        model(data)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
