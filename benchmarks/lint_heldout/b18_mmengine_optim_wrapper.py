# Optimizer wrappers in the MMEngine style: ``OptimWrapper`` drives
# backward/step/zero_grad with gradient accumulation and clipping, and
# ``AmpOptimWrapper`` adds dynamic loss scaling for mixed precision.
import logging
import time
from contextlib import contextmanager
from typing import Dict, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

from mmengine.logging import MessageHub, print_log
from mmengine.model import BaseModel
from mmengine.registry import OPTIM_WRAPPERS


@OPTIM_WRAPPERS.register_module()
class OptimWrapper:
    """Optimizer wrapper provides a common interface for updating parameters.

    Args:
        optimizer (Optimizer): Optimizer used to update model parameters.
        accumulative_counts (int): The number of iterations to accumulate
            gradients. Defaults to 1.
        clip_grad (dict, optional): ``dict(max_norm=35, norm_type=2)`` or
            ``dict(type='value', clip_value=1.0)``.
    """

    def __init__(self, optimizer: Optimizer, accumulative_counts: int = 1, clip_grad: Optional[dict] = None):
        assert accumulative_counts > 0, 'accumulative_counts at least greater than or equal to 1'
        self._accumulative_counts = accumulative_counts
        self.optimizer = optimizer
        self.clip_grad_kwargs = {}
        if clip_grad is not None:
            clip_grad = dict(clip_grad)
            clip_type = clip_grad.pop('type', 'norm')
            if clip_type == 'norm':
                self.clip_func = torch.nn.utils.clip_grad_norm_
                self.grad_name = 'grad_norm'
            elif clip_type == 'value':
                self.clip_func = torch.nn.utils.clip_grad_value_
                self.grad_name = 'grad_value'
            else:
                raise ValueError(f'type of clip_grad should be "norm" or "value" but got {clip_type}')
            self.clip_grad_kwargs = clip_grad
        self.message_hub = MessageHub.get_current_instance()
        self._inner_count = 0
        self._max_counts = -1
        self._remainder_counts = -1

    def update_params(self, loss: torch.Tensor, step_kwargs: Optional[Dict] = None, zero_kwargs: Optional[Dict] = None) -> None:
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
            self._clip_grad()
        self.optimizer.step(**kwargs)

    def _clip_grad(self) -> None:
        params = []
        for param_group in self.optimizer.param_groups:
            params.extend(param_group['params'])
        params = list(filter(lambda p: p.requires_grad and p.grad is not None, params))
        if len(params) > 0:
            grad = self.clip_func(params, **self.clip_grad_kwargs)
            if grad is not None:
                self.message_hub.update_scalar(f'train/{self.grad_name}', float(grad))

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        self._inner_count = init_counts
        self._max_counts = max_counts
        if self._inner_count % self._accumulative_counts != 0:
            print_log('Resumed iteration number is not divisible by accumulative_counts.', logger='current', level=logging.WARNING)
        self._remainder_counts = self._max_counts % self._accumulative_counts

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self._accumulative_counts == 1:
            loss_factor = 1
        elif self._max_counts == -1:
            loss_factor = self._accumulative_counts
        elif self._inner_count < self._max_counts - self._remainder_counts:
            loss_factor = self._accumulative_counts
        else:
            loss_factor = self._remainder_counts
        return loss / loss_factor

    def should_update(self) -> bool:
        return self._inner_count % self._accumulative_counts == 0 or self._inner_count == self._max_counts

    @contextmanager
    def optim_context(self, model: nn.Module):
        # Skip the gradient all-reduce of DDP while accumulating.
        if not self.should_update() and hasattr(model, 'no_sync'):
            with model.no_sync():
                yield
        else:
            yield

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self):
        return self.optimizer.param_groups


@OPTIM_WRAPPERS.register_module()
class AmpOptimWrapper(OptimWrapper):
    """A subclass of :class:`OptimWrapper` that supports automatic mixed
    precision training based on ``torch.amp``.

    Args:
        loss_scale (float or str or dict): ``'dynamic'``, a fixed initial
            scale, or keyword arguments of the GradScaler.
        dtype (str, optional): ``'float16'`` or ``'bfloat16'``; ``None``
            keeps the autocast default.
    """

    valid_dtypes = ('float16', 'bfloat16', None)

    def __init__(self, loss_scale: Union[str, float, dict] = 'dynamic', dtype: Optional[str] = None, **kwargs):
        assert dtype in self.valid_dtypes, f'dtype should be any of {self.valid_dtypes}, got {dtype}'
        super().__init__(**kwargs)
        self._scale_update_param = None
        scaler_kwargs = {}
        if isinstance(loss_scale, float):
            self._scale_update_param = loss_scale
            scaler_kwargs['init_scale'] = loss_scale
        elif isinstance(loss_scale, dict):
            scaler_kwargs.update(loss_scale)
        elif loss_scale != 'dynamic':
            raise TypeError(f'loss_scale must be of type float, dict, or "dynamic", got {loss_scale}')
        try:
            self.loss_scaler = torch.amp.GradScaler('cuda', **scaler_kwargs)
        except (AttributeError, TypeError):
            self.loss_scaler = torch.cuda.amp.GradScaler(**scaler_kwargs)
        self.cast_dtype = getattr(torch, dtype) if dtype is not None else None

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.loss_scaler.scale(loss).backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs) -> None:
        if self.clip_grad_kwargs:
            params = [p for group in self.optimizer.param_groups for p in group['params'] if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, **self.clip_grad_kwargs)  # expect: AMP005
            self.message_hub.update_scalar('train/grad_norm', float(grad_norm))
        self.loss_scaler.step(self.optimizer, **kwargs)  # expect: AMP006

    def state_dict(self) -> dict:
        state_dict = self.optimizer.state_dict()
        state_dict['loss_scaler'] = self.loss_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        if 'loss_scaler' in state_dict:
            self.loss_scaler.load_state_dict(state_dict.pop('loss_scaler'))
        self.optimizer.load_state_dict(state_dict)

    @contextmanager
    def optim_context(self, model: nn.Module):
        with super().optim_context(model), torch.autocast(device_type='cuda', dtype=self.cast_dtype):
            yield


class MaskClassifier(BaseModel):
    """Image classifier with an auxiliary foreground-mask head."""

    def __init__(self, num_classes: int = 10, data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 64, 3, 2, 1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.Conv2d(64, 128, 3, 2, 1), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
        )
        self.cls_head = nn.Linear(128, num_classes)
        self.mask_head = nn.Conv2d(128, 1, 1)

    def forward(self, inputs, labels=None, gt_masks=None, mode: str = 'tensor'):
        feats = self.backbone(inputs)
        cls_score = self.cls_head(torch.flatten(F.adaptive_avg_pool2d(feats, 1), 1))
        mask_logits = F.interpolate(self.mask_head(feats), size=inputs.shape[-2:], mode='bilinear', align_corners=False)
        if mode == 'loss':
            return dict(
                loss_cls=F.cross_entropy(cls_score, labels),
                loss_mask=F.binary_cross_entropy_with_logits(mask_logits.squeeze(1), gt_masks),
            )
        if mode == 'predict':
            return cls_score.softmax(dim=-1), mask_logits.sigmoid()
        return cls_score, mask_logits.sigmoid().squeeze(1)

    def train_step(self, data, optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self._run_forward(data, mode='loss')
        parsed_losses, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed_losses)
        return log_vars


def benchmark_train_speed(model: nn.Module, data_loader, optimizer: Optimizer, num_iters: int = 50, log_interval: int = 10) -> float:
    """Measure raw fp16 training throughput without the wrapper overhead."""
    mask_criterion = nn.BCELoss()
    model.train()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, data_batch in enumerate(data_loader):
        if i == num_iters:
            break
        data = model.data_preprocessor(data_batch, True)
        with torch.autocast(device_type='cuda', dtype=torch.float16):  # expect: AMP010
            cls_score, mask_prob = model(**data, mode='tensor')
            loss_cls = F.cross_entropy(cls_score, data['labels'])
            loss_mask = mask_criterion(mask_prob, data['gt_masks'])  # expect: AMP003
            loss = loss_cls + loss_mask
            optimizer.zero_grad()
            loss.backward()  # expect: AMP008
        optimizer.step()
        if (i + 1) % log_interval == 0:
            print_log(f'iter {i + 1}: loss {loss.item():.4f}', logger='current')
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return num_iters / elapsed
