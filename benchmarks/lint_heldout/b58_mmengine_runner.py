"""A trimmed MMEngine-style runner: config dict, optimizer wrappers, loop, hooks.

``OptimWrapper.update_params(loss)`` does backward / clip / step / zero_grad;
``AmpOptimWrapper`` adds the GradScaler and the autocast of ``optim_context``.
Two wrappers ported from the project's previous codebase are registered too.
"""
import copy
import logging
from contextlib import contextmanager, nullcontext
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger("mmengine-lite")

cfg = dict(
    model=dict(type="BoundaryAwareSegmentor", num_classes=19, edge_prior=0.08),
    optim_wrapper=dict(
        type="AmpOptimWrapper",
        dtype="float16",
        loss_scale="dynamic",
        optimizer=dict(type="AdamW", lr=6e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
        clip_grad=dict(max_norm=1.0, norm_type=2),
        accumulative_counts=2,
    ),
    train_cfg=dict(type="IterBasedTrainLoop", max_iters=80000, val_interval=8000),
    custom_hooks=[dict(type="EMAHook", momentum=0.0002), dict(type="CheckInvalidLossHook", interval=50)],
    best_score=-1e9,
)


class BaseOptimWrapper:
    def __init__(self, optimizer, accumulative_counts=1):
        self.optimizer = optimizer
        self._accumulative_counts = accumulative_counts
        self._inner_count = 0
        self._max_counts = -1

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, **kwargs):
        self.optimizer.zero_grad(**kwargs)

    def should_update(self):
        return self._inner_count % self._accumulative_counts == 0 or self._inner_count == self._max_counts

    def scale_loss(self, loss):
        return loss / self._accumulative_counts

    def state_dict(self):
        return self.optimizer.state_dict()


class OptimWrapper(BaseOptimWrapper):
    def __init__(self, optimizer, accumulative_counts=1, clip_grad: Optional[dict] = None):
        super().__init__(optimizer, accumulative_counts)
        self.clip_grad_kwargs = dict(clip_grad or {})
        clip_type = self.clip_grad_kwargs.pop("type", "norm")
        self.clip_func = torch.nn.utils.clip_grad_norm_ if clip_type == "norm" else torch.nn.utils.clip_grad_value_

    def update_params(self, loss, step_kwargs=None, zero_kwargs=None):
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))

    def backward(self, loss, **kwargs):
        loss.backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs):
        if self.clip_grad_kwargs:
            self._clip_grad()
        self.optimizer.step(**kwargs)

    def _clip_grad(self):
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad and p.grad is not None]
        if params:
            grad_norm = self.clip_func(params, **self.clip_grad_kwargs)
            self.last_grad_norm = float(grad_norm)

    @contextmanager
    def optim_context(self, model):
        if not self.should_update() and hasattr(model, "no_sync"):
            with model.no_sync():
                yield
        else:
            yield


class AmpOptimWrapper(OptimWrapper):
    valid_dtypes = ("float16", "bfloat16", None)

    def __init__(self, loss_scale="dynamic", dtype=None, **kwargs):
        super().__init__(**kwargs)
        assert dtype in self.valid_dtypes
        self._scale_update_param = None
        if loss_scale == "dynamic":
            self.loss_scaler = torch.amp.GradScaler("cuda")
        elif isinstance(loss_scale, float):
            self._scale_update_param = loss_scale
            self.loss_scaler = torch.amp.GradScaler("cuda", init_scale=loss_scale)
        else:
            self.loss_scaler = torch.amp.GradScaler("cuda", **loss_scale)
        self.cast_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def backward(self, loss, **kwargs):
        self.loss_scaler.scale(loss).backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs):
        if self.clip_grad_kwargs:
            self.loss_scaler.unscale_(self.optimizer)
            self._clip_grad()
        self.loss_scaler.step(self.optimizer, **kwargs)
        self.loss_scaler.update(self._scale_update_param)

    def state_dict(self):
        state = super().state_dict()
        state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    @contextmanager
    def optim_context(self, model):
        with super().optim_context(model), torch.autocast("cuda", dtype=self.cast_dtype):
            yield


class FP16ClipOptimWrapper(BaseOptimWrapper):
    """Ported from the previous codebase (kept for the old configs)."""

    def __init__(self, optimizer, accumulative_counts=1, clip_grad=None, init_scale=2.0 ** 16):
        super().__init__(optimizer, accumulative_counts)
        self.clip_grad_kwargs = dict(clip_grad or {})
        self.grad_scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)

    def update_params(self, loss, step_kwargs=None, zero_kwargs=None):
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            self.step()
            self.zero_grad()

    def backward(self, loss, **kwargs):
        self.grad_scaler.scale(loss).backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs):
        if self.clip_grad_kwargs:
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, **self.clip_grad_kwargs)  # expect: AMP005
        self.grad_scaler.step(self.optimizer, **kwargs)
        self.grad_scaler.update()

    @contextmanager
    def optim_context(self, model):
        with torch.autocast("cuda", dtype=torch.float16):
            yield


class LegacyAmpOptimWrapper(BaseOptimWrapper):
    def __init__(self, optimizer, accumulative_counts=1):
        super().__init__(optimizer, accumulative_counts)
        self.scaler = torch.amp.GradScaler("cuda")

    def update_params(self, loss, step_kwargs=None, zero_kwargs=None):
        loss = self.scale_loss(loss)
        loss = self.scaler.scale(loss)
        loss.backward()
        self._inner_count += 1
        if self.should_update():
            self.optimizer.step()  # expect: AMP006
            self.zero_grad()

    def optim_context(self, model):
        return nullcontext()


OPTIM_WRAPPERS = {
    "OptimWrapper": OptimWrapper,
    "AmpOptimWrapper": AmpOptimWrapper,
    "FP16ClipOptimWrapper": FP16ClipOptimWrapper,
    "LegacyAmpOptimWrapper": LegacyAmpOptimWrapper,
}


def build_optim_wrapper(model, optim_cfg):
    optim_cfg = copy.deepcopy(optim_cfg)
    wrapper_type = optim_cfg.pop("type")
    opt_cfg = optim_cfg.pop("optimizer")
    opt_type = opt_cfg.pop("type")
    optimizer = getattr(torch.optim, opt_type)(model.parameters(), **opt_cfg)
    return OPTIM_WRAPPERS[wrapper_type](optimizer=optimizer, **optim_cfg)


class SegDataPreProcessor(nn.Module):
    def __init__(self, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(-1, 1, 1), False)
        self.register_buffer("std", torch.tensor(std).view(-1, 1, 1), False)

    def forward(self, data, training=False):
        inputs = (data["inputs"].float() - self.mean) / self.std
        return dict(inputs=inputs, gt_sem_seg=data.get("gt_sem_seg"), gt_edge=data.get("gt_edge"))


class TinySegmentor(nn.Module):
    def __init__(self, num_classes=19):
        super().__init__()
        self.data_preprocessor = SegDataPreProcessor()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 64, 3, 2, 1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.Conv2d(64, 128, 3, 2, 1), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
        )
        self.decode = nn.Conv2d(128, num_classes, 1)
        self.loss_decode = nn.CrossEntropyLoss(ignore_index=255)

    def forward(self, inputs, gt=None, mode="tensor"):
        seg_logits = self.decode(self.backbone(inputs))
        seg_logits = F.interpolate(seg_logits, size=inputs.shape[-2:], mode="bilinear", align_corners=False)
        if mode == "loss":
            return dict(loss_seg=self.loss_decode(seg_logits, gt))
        return seg_logits

    def parse_losses(self, losses: Dict[str, torch.Tensor]):
        log_vars = [(name, value.mean()) for name, value in losses.items()]
        loss = sum(v for k, v in log_vars if "loss" in k)
        log_vars.insert(0, ("loss", loss))
        return loss, {k: v.item() for k, v in log_vars}

    def train_step(self, data, optim_wrapper):
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self(data["inputs"], data["gt_sem_seg"], mode="loss")
        parsed_losses, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed_losses)
        return log_vars

    def val_step(self, data):
        data = self.data_preprocessor(data, False)
        return self(data["inputs"], mode="predict").argmax(dim=1)


class BoundaryAwareSegmentor(TinySegmentor):
    def __init__(self, num_classes=19, edge_prior=0.08):
        super().__init__(num_classes)
        self.boundary = nn.Conv2d(128, 1, 1)
        self.edge_prior = edge_prior

    def train_step(self, data, optim_wrapper):
        data = self.data_preprocessor(data, True)
        with torch.autocast("cuda", dtype=torch.float16):
            feats = self.backbone(data["inputs"])
            seg_logits = F.interpolate(self.decode(feats), size=data["inputs"].shape[-2:], mode="bilinear")
            edge_prob = torch.sigmoid(self.boundary(feats))
            loss_seg = self.loss_decode(seg_logits, data["gt_sem_seg"])
            gt_edge = F.interpolate(data["gt_edge"], size=edge_prob.shape[-2:], mode="nearest")
            loss_edge = F.binary_cross_entropy(edge_prob, gt_edge)  # expect: AMP003
            loss_prior = (edge_prob.mean() - self.edge_prior).abs().float()  # expect: AMP004
        losses = dict(loss_seg=loss_seg, loss_edge=loss_edge, loss_prior=0.1 * loss_prior)
        parsed_losses, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed_losses)
        return log_vars


MODELS = {"TinySegmentor": TinySegmentor, "BoundaryAwareSegmentor": BoundaryAwareSegmentor}


class EMAHook:
    def __init__(self, momentum=0.0002):
        self.momentum = momentum
        self.ema = None

    def before_train(self, runner):
        self.ema = copy.deepcopy(runner.model).requires_grad_(False)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        with torch.no_grad():
            for p_ema, p in zip(self.ema.parameters(), runner.model.parameters()):
                p_ema.lerp_(p, self.momentum)


class CheckInvalidLossHook:
    def __init__(self, interval=50):
        self.interval = interval

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if batch_idx % self.interval == 0 and outputs is not None:
            assert torch.isfinite(torch.tensor(outputs["loss"])), "loss became infinite or NaN!"


HOOKS = {"EMAHook": EMAHook, "CheckInvalidLossHook": CheckInvalidLossHook}


class Runner:
    def __init__(self, config, train_dataloader, val_dataloader=None):
        self.cfg = copy.deepcopy(config)
        model_cfg = dict(self.cfg["model"])
        self.model = MODELS[model_cfg.pop("type")](**model_cfg).cuda()
        self.optim_wrapper = build_optim_wrapper(self.model, self.cfg["optim_wrapper"])
        self.hooks = [HOOKS[h.pop("type")](**h) for h in copy.deepcopy(self.cfg["custom_hooks"])]
        self.train_dataloader = train_dataloader
        self.val_dataloader = val_dataloader
        self.best_score = self.cfg["best_score"]
        self.iter = 0

    def call_hook(self, name, **kwargs):
        for hook in self.hooks:
            fn = getattr(hook, name, None)
            if fn is not None:
                fn(self, **kwargs)

    def train(self):
        max_iters = self.cfg["train_cfg"]["max_iters"]
        val_interval = self.cfg["train_cfg"]["val_interval"]
        self.call_hook("before_train")
        data_iter = iter(self.train_dataloader)
        while self.iter < max_iters:
            self.model.train()
            try:
                data_batch = next(data_iter)
            except StopIteration:
                data_iter = iter(self.train_dataloader)
                data_batch = next(data_iter)
            outputs = self.model.train_step(data_batch, optim_wrapper=self.optim_wrapper)
            self.call_hook("after_train_iter", batch_idx=self.iter, data_batch=data_batch, outputs=outputs)
            self.iter += 1
            if self.val_dataloader is not None and self.iter % val_interval == 0:
                self.val()

    def val(self):
        self.model.eval()
        correct = total = 0
        with torch.no_grad():
            for data_batch in self.val_dataloader:
                pred = self.model.val_step(data_batch)
                gt = data_batch["gt_sem_seg"].to(pred.device)
                valid = gt != 255
                correct += (pred[valid] == gt[valid]).sum().item()
                total += valid.sum().item()
        score = correct / max(total, 1)
        if score > self.best_score:
            self.best_score = score
            torch.save({k: v.half() for k, v in self.model.state_dict().items()}, "best_fp16.pth")
        self.model.train()
