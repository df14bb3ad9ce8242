# Copyright (c) OpenMMLab-style research code. All rights reserved.
"""Optimizer wrappers, a classifier and a training loop in the mmengine style.

Configs pick the wrapper by name::

    optim_wrapper = dict(
        type='AmpOptimWrapper',
        dtype='float16',
        loss_scale='dynamic',
        optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05),
        clip_grad=dict(max_norm=5.0))

Older releases built the scaler with ``torch.cuda.amp.GradScaler``; the device
dispatch below keeps NPU and MLU working.
"""
import logging
from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

from mmlite.device import get_device, is_mlu_available, is_npu_available
from mmlite.hooks import Hook
from mmlite.registry import MODELS

if is_npu_available():
    from torch.npu.amp import GradScaler
elif is_mlu_available():
    from torch.mlu.amp import GradScaler
else:
    from torch.amp import GradScaler

logger = logging.getLogger("mmlite")

OPTIM_WRAPPERS: Dict[str, type] = {}


def register_optim_wrapper(cls):
    OPTIM_WRAPPERS[cls.__name__] = cls
    return cls


@register_optim_wrapper
class OptimWrapper:
    """Wraps an optimizer: gradient accumulation, clipping and a uniform API."""

    def __init__(self, optimizer, accumulative_counts: int = 1, clip_grad: Optional[dict] = None):
        assert accumulative_counts > 0
        self.optimizer = optimizer
        self._accumulative_counts = accumulative_counts
        self._inner_count = 0
        self._max_counts = -1
        self._remainder_counts = -1
        self.grad_norm = None
        self.clip_grad_kwargs = dict(clip_grad) if clip_grad else {}
        if self.clip_grad_kwargs:
            clip_type = self.clip_grad_kwargs.pop("type", "norm")
            if clip_type == "norm":
                self._clip_func = clip_grad_norm_
            elif clip_type == "value":
                self._clip_func = clip_grad_value_
            else:
                raise ValueError(f"type of clip_grad should be 'norm' or 'value', got {clip_type}")

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int):
        self._inner_count = init_counts
        self._max_counts = max_counts
        if self._inner_count % self._accumulative_counts != 0:
            logger.warning("Resumed iteration number is not divisible by accumulative_counts")
        self._remainder_counts = self._max_counts % self._accumulative_counts

    def _trainable_params(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]
                if p.requires_grad and p.grad is not None]

    def update_params(self, loss: torch.Tensor, step_kwargs: Optional[Dict] = None,
                      zero_kwargs: Optional[Dict] = None) -> None:
        step_kwargs = step_kwargs or {}
        zero_kwargs = zero_kwargs or {}
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            self.step(**step_kwargs)
            self.zero_grad(**zero_kwargs)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss.backward(**kwargs)
        self._inner_count += 1

    def zero_grad(self, **kwargs) -> None:
        self.optimizer.zero_grad(**kwargs)

    def step(self, **kwargs) -> None:
        if self.clip_grad_kwargs:
            params = self._trainable_params()
            if params:
                self.grad_norm = self._clip_func(params, **self.clip_grad_kwargs)
        self.optimizer.step(**kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self._accumulative_counts == 1:
            loss_factor = 1
        elif self._max_counts == -1:
            loss_factor = self._accumulative_counts
        else:
            if self._inner_count < self._max_counts - self._remainder_counts:
                loss_factor = self._accumulative_counts
            else:
                loss_factor = self._remainder_counts
        return loss / loss_factor

    def should_update(self) -> bool:
        return self._inner_count % self._accumulative_counts == 0 or self._inner_count == self._max_counts

    def should_sync(self) -> bool:
        return (self._inner_count + 1) % self._accumulative_counts == 0 or (self._inner_count + 1) == self._max_counts

    @contextmanager
    def optim_context(self, model: nn.Module):
        if not self.should_sync() and hasattr(model, "no_sync"):
            with model.no_sync():
                yield
        else:
            yield

    def get_lr(self) -> Dict[str, List[float]]:
        return {"lr": [group["lr"] for group in self.optimizer.param_groups]}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


@register_optim_wrapper
class AmpOptimWrapper(OptimWrapper):
    """OptimWrapper with automatic mixed precision and dynamic loss scaling."""

    valid_dtypes = ("float16", "bfloat16", None)

    def __init__(self, loss_scale="dynamic", dtype: Optional[str] = None, **kwargs):
        assert dtype in self.valid_dtypes, f"dtype should be any of {self.valid_dtypes}, got {dtype}"
        super().__init__(**kwargs)
        self._scale_update_param = None
        if loss_scale == "dynamic":
            self.loss_scaler = GradScaler()
        elif isinstance(loss_scale, float):
            self._scale_update_param = loss_scale
            self.loss_scaler = GradScaler(init_scale=loss_scale)
        elif isinstance(loss_scale, dict):
            self.loss_scaler = GradScaler(**loss_scale)
        else:
            raise TypeError(f"loss_scale must be 'dynamic', a float or a dict, got {loss_scale}")
        self.cast_dtype = None if dtype is None else getattr(torch, dtype)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.loss_scaler.scale(loss).backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs) -> None:
        if self.clip_grad_kwargs:
            self.grad_norm = clip_grad_norm_(self._trainable_params(), **self.clip_grad_kwargs)  # expect: AMP005
        self.loss_scaler.step(self.optimizer, **kwargs)
        self.loss_scaler.update(self._scale_update_param)

    def state_dict(self) -> dict:
        state_dict = self.optimizer.state_dict()
        state_dict["loss_scaler"] = self.loss_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        if "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict.pop("loss_scaler"))
        self.optimizer.load_state_dict(state_dict)

    @contextmanager
    def optim_context(self, model: nn.Module):
        with super().optim_context(model), torch.autocast(device_type=get_device(), dtype=self.cast_dtype):
            yield


def build_optim_wrapper(model: nn.Module, cfg: dict) -> OptimWrapper:
    cfg = dict(cfg)
    wrapper_type = cfg.pop("type", "OptimWrapper")
    optim_cfg = dict(cfg.pop("optimizer"))
    opt_type = optim_cfg.pop("type", "AdamW")
    weight_decay = optim_cfg.get("weight_decay", 0.0)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = getattr(torch.optim, opt_type)(groups, **optim_cfg)
    return OPTIM_WRAPPERS[wrapper_type](optimizer=optimizer, **cfg)


class AttnPoolClsHead(nn.Module):
    """Attention pooling over the last feature map followed by a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, num_heads: int = 8, label_smooth: float = 0.0):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(1, 1, in_channels))
        self.attn = nn.MultiheadAttention(in_channels, num_heads, batch_first=True)
        self.fc = nn.Linear(in_channels, num_classes)
        self.loss_module = nn.CrossEntropyLoss(label_smoothing=label_smooth)

    def pre_logits(self, feats: Tuple[torch.Tensor]) -> torch.Tensor:
        x = feats[-1]
        tokens = x.flatten(2).transpose(1, 2)
        q = self.query.expand(tokens.size(0), -1, -1)
        pooled, _ = self.attn(q, tokens, tokens, need_weights=False)
        return pooled.squeeze(1)

    def forward(self, feats):
        return self.fc(self.pre_logits(feats))

    def loss(self, feats, data_samples) -> Dict[str, torch.Tensor]:
        cls_score = self(feats)
        target = torch.stack([ds["gt_label"] for ds in data_samples])
        if "valid_classes" in data_samples[0]:
            # multi-dataset batches: each sample only competes among its own label space
            valid = torch.stack([ds["valid_classes"] for ds in data_samples]).bool()
            cls_score = cls_score.masked_fill(~valid, torch.finfo(cls_score.dtype).min)
        loss = self.loss_module(cls_score, target)
        return {"loss_cls": loss}

    def predict(self, feats, data_samples=None):
        return F.softmax(self(feats), dim=1)


class ImageClassifier(nn.Module):
    def __init__(self, backbone: dict, head: dict, data_preprocessor: dict):
        super().__init__()
        self.backbone = MODELS.build(backbone)
        self.data_preprocessor = MODELS.build(data_preprocessor)
        self.head = AttnPoolClsHead(**head)

    def extract_feat(self, inputs):
        return self.backbone(inputs)

    def forward(self, inputs, data_samples=None, mode: str = "tensor"):
        feats = self.extract_feat(inputs)
        if mode == "loss":
            return self.head.loss(feats, data_samples)
        if mode == "predict":
            return self.head.predict(feats, data_samples)
        return self.head(feats)

    def parse_losses(self, losses: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        log_vars = []
        for loss_name, loss_value in losses.items():
            if isinstance(loss_value, torch.Tensor):
                log_vars.append([loss_name, loss_value.mean()])
            elif isinstance(loss_value, (list, tuple)):
                log_vars.append([loss_name, sum(_loss.mean() for _loss in loss_value)])
            else:
                raise TypeError(f"{loss_name} is not a tensor or list of tensors")
        loss = sum(value for key, value in log_vars if "loss" in key)
        log_vars.insert(0, ["loss", loss])
        return loss, OrderedDict(log_vars)

    def train_step(self, data: dict, optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self(**data, mode="loss")
        parsed_losses, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed_losses)
        return log_vars

    def val_step(self, data: dict):
        data = self.data_preprocessor(data, False)
        return self(**data, mode="predict")


class LinearProbeHook(Hook):
    """Every ``interval`` epochs, fit a linear classifier on frozen backbone features."""

    priority = "LOW"

    def __init__(self, feat_dim: int, num_classes: int, interval: int = 10, probe_epochs: int = 20,
                 batch_size: int = 1024, lr: float = 0.1):
        self.interval = interval
        self.probe_epochs = probe_epochs
        self.batch_size = batch_size
        self.probe = nn.Linear(feat_dim, num_classes)
        self.optimizer = torch.optim.SGD(self.probe.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)  # expect: AMP010

    def after_train_epoch(self, runner) -> None:
        if not self.every_n_epochs(runner, self.interval):
            return
        feats, labels = self._extract(runner.model, runner.val_dataloader)
        acc = self._fit_probe(feats, labels)
        runner.message_hub.update_scalar("probe/top1", acc)
        runner.logger.info(f"Epoch(probe) [{runner.epoch}] top1: {acc:.4f}")

    @torch.no_grad()
    def _extract(self, model, loader):
        model.eval()
        feats, labels = [], []
        for data in loader:
            data = model.data_preprocessor(data, False)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                f = model.extract_feat(data["inputs"])[-1]
            feats.append(f.float().mean(dim=(2, 3)))
            labels.append(torch.stack([ds["gt_label"] for ds in data["data_samples"]]))
        model.train()
        return torch.cat(feats), torch.cat(labels).to(feats[0].device)

    def _fit_probe(self, feats: torch.Tensor, labels: torch.Tensor) -> float:
        self.probe.to(feats.device)
        feats = F.layer_norm(feats, feats.shape[-1:])
        n = feats.size(0)
        for _ in range(self.probe_epochs):
            perm = torch.randperm(n, device=feats.device)
            for i in range(0, n, self.batch_size):
                idx = perm[i:i + self.batch_size]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = self.probe(feats[idx])
                    loss = F.cross_entropy(logits, labels[idx])
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
        with torch.no_grad():
            pred = self.probe(feats).argmax(dim=-1)
        return (pred == labels).float().mean().item()


class IterBasedTrainLoop:
    def __init__(self, model: ImageClassifier, dataloader, optim_wrapper: OptimWrapper, max_iters: int,
                 val_loader=None, val_interval: int = 1000, hooks=()):
        self.model = model
        self.dataloader = dataloader
        self.optim_wrapper = optim_wrapper
        self.max_iters = max_iters
        self.val_loader = val_loader
        self.val_interval = val_interval
        self.hooks = list(hooks)
        self._iter = 0
        self.optim_wrapper.initialize_count_status(model, 0, max_iters)

    def run(self):
        data_iter = iter(self.dataloader)
        while self._iter < self.max_iters:
            try:
                data_batch = next(data_iter)
            except StopIteration:
                data_iter = iter(self.dataloader)
                data_batch = next(data_iter)
            self.run_iter(data_batch)
            if self.val_loader is not None and self._iter % self.val_interval == 0:
                self.run_val()

    def run_iter(self, data_batch):
        log_vars = self.model.train_step(data_batch, optim_wrapper=self.optim_wrapper)
        self._iter += 1
        if self._iter % 50 == 0:
            lr = self.optim_wrapper.get_lr()["lr"][0]
            msg = "  ".join(f"{k}: {v.item():.4f}" for k, v in log_vars.items())
            grad_norm = self.optim_wrapper.grad_norm
            logger.info(f"Iter(train) [{self._iter}/{self.max_iters}] lr: {lr:.3e}  {msg}  grad_norm: {grad_norm}")

    def run_val(self):
        self.model.eval()
        correct, total = 0, 0
        with torch.no_grad():
            for data in self.val_loader:
                scores = self.model.val_step(data)
                target = torch.stack([ds["gt_label"] for ds in data["data_samples"]]).to(scores.device)
                correct += (scores.argmax(dim=1) == target).sum().item()
                total += target.numel()
        self.model.train()
        logger.info(f"Iter(val) [{self._iter}] accuracy/top1: {100.0 * correct / max(total, 1):.2f}")


def train(cfg: dict, train_loader, val_loader):
    model = ImageClassifier(**cfg["model"]).to(get_device())
    optim_wrapper = build_optim_wrapper(model, cfg["optim_wrapper"])
    if "load_from" in cfg:
        state = torch.load(cfg["load_from"], map_location="cpu")
        model.load_state_dict(state["state_dict"])
        optim_wrapper.load_state_dict(state["optimizer"])
    loop = IterBasedTrainLoop(model, train_loader, optim_wrapper, cfg["max_iters"], val_loader=val_loader,
                              val_interval=cfg.get("val_interval", 1000))
    loop.run()
    torch.save({"state_dict": model.state_dict(), "optimizer": optim_wrapper.state_dict()}, cfg["work_dir"] + "/last.pth")
    return model
