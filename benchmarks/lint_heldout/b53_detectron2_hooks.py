# Copyright (c) the detlite authors. Licensed under the Apache License 2.0.
"""Trainers and hooks for detlite (a Detectron2-style detection toolbox).

``SimpleTrainer`` runs plain fp32 steps; ``AMPTrainer`` runs the model under autocast
and scales the loss with a GradScaler (historically ``torch.cuda.amp.GradScaler``, now
created through the device-generic API where available). Gradient clipping is applied
inside the optimizer's ``step`` (see ``maybe_add_gradient_clipping``), which GradScaler
calls only after it has unscaled the gradients.
"""
import copy
import logging
import math
import os
import time
import weakref

import numpy as np
import torch

logger = logging.getLogger(__name__)
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split(".")[:2])


def _autocast(dtype=torch.float16, enabled=True):
    if TORCH_VERSION >= (2, 4):
        ctx = torch.amp.autocast("cuda", dtype=dtype, enabled=enabled)
    else:
        ctx = torch.cuda.amp.autocast(dtype=dtype, enabled=enabled)
    return ctx


def maybe_add_gradient_clipping(clip_norm, optimizer_type):
    """Return a subclass of ``optimizer_type`` whose ``step`` clips gradients first."""
    if clip_norm <= 0:
        return optimizer_type

    def optimizer_wgc_step(self, closure=None):
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], clip_norm)
        super(type(self), self).step(closure)

    return type(optimizer_type.__name__ + "WithGradientClip", (optimizer_type,), {"step": optimizer_wgc_step})


class HookBase:
    trainer = None

    def before_train(self):
        pass

    def after_train(self):
        pass

    def before_step(self):
        pass

    def after_step(self):
        pass

    def state_dict(self):
        return {}


class TrainerBase:
    def __init__(self):
        self._hooks = []
        self.iter = self.start_iter = self.max_iter = 0
        self.storage = {}

    def register_hooks(self, hooks):
        for h in hooks:
            h.trainer = weakref.proxy(self)
        self._hooks.extend(hooks)

    def train(self, start_iter, max_iter):
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        for h in self._hooks:
            h.before_train()
        try:
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

    def run_step(self):
        raise NotImplementedError


class SimpleTrainer(TrainerBase):
    def __init__(self, model, data_loader, optimizer):
        super().__init__()
        model.train()
        self.model, self.data_loader, self.optimizer = model, data_loader, optimizer
        self._data_loader_iter = iter(data_loader)

    def run_step(self):
        assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        loss_dict = self.model(data)
        losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        self._write_metrics(loss_dict, data_time)
        self.optimizer.step()

    def _write_metrics(self, loss_dict, data_time):
        metrics = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        total_losses_reduced = sum(metrics.values())
        if not np.isfinite(total_losses_reduced):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.iter}!\nloss_dict = {metrics}")
        self.storage.update(metrics, total_loss=total_losses_reduced, data_time=data_time)


class AMPTrainer(SimpleTrainer):
    """Like SimpleTrainer, but uses autocast and a GradScaler in the training loop."""

    def __init__(self, model, data_loader, optimizer, grad_scaler=None, precision=torch.float16, clip_grad_norm=0.0):
        super().__init__(model, data_loader, optimizer)
        if grad_scaler is None:
            grad_scaler = torch.cuda.amp.GradScaler(enabled=precision == torch.float16)  # expect: AMP009
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.clip_grad_norm = clip_grad_norm

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        assert torch.cuda.is_available(), "[AMPTrainer] CUDA is required for AMP training!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        with _autocast(dtype=self.precision):
            loss_dict = self.model(data)
            losses = loss_dict if isinstance(loss_dict, torch.Tensor) else sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        if self.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)  # expect: AMP005
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def state_dict(self):
        return {"grad_scaler": self.grad_scaler.state_dict()}


# --------------------------------------------------------------------------- hooks
class IterationTimer(HookBase):
    def __init__(self, warmup_iter=3):
        self._warmup_iter, self._step_start, self._times = warmup_iter, None, []

    def before_step(self):
        self._step_start = time.perf_counter()

    def after_step(self):
        if self.trainer.iter - self.trainer.start_iter >= self._warmup_iter:
            self._times.append(time.perf_counter() - self._step_start)

    def after_train(self):
        if self._times:
            logger.info("Overall training speed: %.4f s / it", float(np.mean(self._times)))


class GradScalerMonitor(HookBase):
    """Logs the loss scale; a scale that keeps falling points at fp16 overflow in the model."""

    def __init__(self, period=20):
        self._period = period

    def after_step(self):
        scaler = getattr(self.trainer, "grad_scaler", None)
        if not isinstance(scaler, (torch.amp.GradScaler, torch.cuda.amp.GradScaler)) or not scaler.is_enabled():
            return
        if (self.trainer.iter + 1) % self._period == 0:
            scale = scaler.get_scale()
            self.trainer.storage["loss_scale"] = scale
            if scale < 1.0:
                logger.warning("Loss scale collapsed to %g at iter %d", scale, self.trainer.iter)


class ModelEMAHook(HookBase):
    """Keeps an fp32 exponential moving average of the weights on the training device."""

    def __init__(self, model, decay=0.9998, warmup=2000):
        self.decay, self.warmup = decay, warmup
        self.state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
        self.model = model

    @torch.no_grad()
    def after_step(self):
        it = self.trainer.iter + 1
        decay = self.decay * (1 - math.exp(-it / self.warmup))
        for k, v in self.model.state_dict().items():
            if v.dtype.is_floating_point:
                self.state[k].mul_(decay).add_(v.detach().float(), alpha=1 - decay)
            else:
                self.state[k].copy_(v)

    def ema_model(self):
        ema = copy.deepcopy(self.model)
        ema.load_state_dict(self.state)
        return ema.eval()


class EvalHook(HookBase):
    def __init__(self, eval_period, eval_function, ema_hook=None):
        self._period, self._func, self._ema_hook = eval_period, eval_function, ema_hook
        self.best_ap = -1e9

    def _do_eval(self):
        model = self._ema_hook.ema_model() if self._ema_hook is not None else self.trainer.model
        model.eval()
        with torch.no_grad(), _autocast(torch.float16):
            results = self._func(model)
        self.trainer.model.train()
        ap = float(results.get("bbox/AP", float("nan")))
        if ap > self.best_ap:
            self.best_ap = ap
        self.trainer.storage.update({f"eval/{k}": v for k, v in results.items()})

    def after_step(self):
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0 and next_iter != self.trainer.max_iter:
            self._do_eval()

    def after_train(self):
        if self.trainer.iter + 1 >= self.trainer.max_iter:
            self._do_eval()


class PeriodicCheckpointer(HookBase):
    def __init__(self, output_dir, period, max_to_keep=3, save_fp16_final=True):
        self.output_dir, self.period, self.max_to_keep = output_dir, period, max_to_keep
        self.save_fp16_final, self._saved = save_fp16_final, []

    def _save(self, name):
        state = {"model": self.trainer.model.state_dict(), "optimizer": self.trainer.optimizer.state_dict(),
                 "iteration": self.trainer.iter}
        if hasattr(self.trainer, "grad_scaler"):
            state["grad_scaler"] = self.trainer.grad_scaler.state_dict()
        path = os.path.join(self.output_dir, f"{name}.pth")
        torch.save(state, path)
        return path

    def after_step(self):
        if (self.trainer.iter + 1) % self.period == 0:
            self._saved.append(self._save(f"model_{self.trainer.iter:07d}"))
            while len(self._saved) > self.max_to_keep:
                os.remove(self._saved.pop(0))

    def after_train(self):
        self._save("model_final")
        if self.save_fp16_final:
            weights = {k: v.half() if v.is_floating_point() else v for k, v in self.trainer.model.state_dict().items()}
            torch.save({"model": weights}, os.path.join(self.output_dir, "model_final_fp16.pth"))


def postprocess_detections(outputs, score_thresh=0.05, topk=100):
    """Keep the top-k boxes per image; boxes under the threshold are pushed to the bottom."""
    results = []
    for inst in outputs:
        scores = inst["scores"].float()
        scores[scores < score_thresh] = -1e9
        keep = scores.topk(min(topk, scores.numel())).indices
        keep = keep[scores[keep] > -1e9]
        results.append({"boxes": inst["boxes"][keep].float(), "scores": scores[keep], "labels": inst["labels"][keep]})
    return results


def greedy_match(iou):
    """Greedy one-to-one matching on a CPU copy of the IoU matrix."""
    costs = -iou.detach().cpu().numpy()
    pairs = []
    for _ in range(min(costs.shape)):
        i, j = np.unravel_index(np.argmin(costs), costs.shape)
        pairs.append((int(i), int(j)))
        costs[i, :] = 1e9
        costs[:, j] = 1e9
    return pairs


@torch.inference_mode()
def benchmark_inference(model, batch, iters=50):
    model = copy.deepcopy(model).half().eval()
    images = [{"image": x["image"].cuda().half()} for x in batch]
    for _ in range(5):
        model(images)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        model(images)
    torch.cuda.synchronize()
    return iters * len(images) / (time.perf_counter() - start)


def build_trainer(cfg, model, data_loader):
    optimizer_cls = maybe_add_gradient_clipping(cfg["clip_grad_norm"], torch.optim.SGD)
    optimizer = optimizer_cls(model.parameters(), lr=cfg["base_lr"], momentum=0.9, weight_decay=1e-4)
    if cfg["amp"]:
        trainer = AMPTrainer(model, data_loader, optimizer, precision=cfg.get("amp_dtype", torch.float16))
    else:
        trainer = SimpleTrainer(model, data_loader, optimizer)
    ema = ModelEMAHook(model) if cfg.get("ema") else None
    hooks = [IterationTimer(), GradScalerMonitor(), PeriodicCheckpointer(cfg["output_dir"], 5000)]
    hooks += [h for h in (ema, EvalHook(cfg["eval_period"], cfg["eval_fn"], ema)) if h is not None]
    trainer.register_hooks(hooks)
    return trainer
