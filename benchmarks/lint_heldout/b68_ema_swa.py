""" Exponential moving average and SWA helpers used by the image-classification trainers.

ModelEmaV3-style EMA (optional warmup, foreach lerp, optional half-precision shadow
kept on another device), SWA bookkeeping, and the native AMP loss scaler used by
``train_one_epoch``. Adapted from timm.
"""
import logging
import math
from collections import OrderedDict
from contextlib import suppress
from copy import deepcopy
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel

_logger = logging.getLogger(__name__)


def dispatch_clip_grad(parameters, value: float, mode: str = "norm", norm_type: float = 2.0):
    if mode == "norm":
        return torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
    else:
        raise ValueError(f"Unknown clip mode ({mode}).")


def _make_grad_scaler(device: str = "cuda"):
    try:
        return torch.amp.GradScaler(device)
    except (AttributeError, TypeError):
        # torch < 2.3 has no device-generic GradScaler
        return torch.cuda.amp.GradScaler()


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device: str = "cuda"):
        self._scaler = _make_grad_scaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's params in-place
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


class ModelEmaV3(nn.Module):
    """EMA of model weights.

    Args:
        decay: base decay.
        warmup_gamma / warmup_power: decay warm-up, ``1 - (1 + step / gamma) ** -power``.
        half: keep the shadow copy in fp16 (for very large models offloaded to CPU).
    """

    def __init__(self, model, decay: float = 0.9999, min_decay: float = 0.0, use_warmup: bool = False,
                 warmup_gamma: float = 1.0, warmup_power: float = 2 / 3, device=None,
                 foreach: bool = True, half: bool = False):
        super().__init__()
        self.module = deepcopy(model)
        self.module.eval()
        self.module.requires_grad_(False)
        if half:
            self.module.half()
        self.decay = decay
        self.min_decay = min_decay
        self.use_warmup = use_warmup
        self.warmup_gamma = warmup_gamma
        self.warmup_power = warmup_power
        self.foreach = foreach and not half
        self.device = device
        if self.device is not None and device != next(model.parameters()).device:
            self.foreach = False
            self.module.to(device=device)

    def get_decay(self, step: Optional[int] = None) -> float:
        if step is None:
            return self.decay
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            return max(min(decay, self.decay), self.min_decay)
        return self.decay

    @torch.no_grad()
    def update(self, model, step: Optional[int] = None):
        decay = self.get_decay(step)
        ema_params, model_params = [], []
        for ema_p, model_p in zip(self.module.parameters(), model.parameters()):
            if ema_p.is_floating_point():
                if self.foreach:
                    ema_params.append(ema_p)
                    model_params.append(model_p)
                else:
                    ema_p.lerp_(model_p.to(device=ema_p.device, dtype=ema_p.dtype), weight=1.0 - decay)
        if self.foreach and ema_params:
            torch._foreach_lerp_(ema_params, model_params, weight=1.0 - decay)
        for ema_b, model_b in zip(self.module.buffers(), model.buffers()):
            ema_b.copy_(model_b.to(device=ema_b.device, dtype=ema_b.dtype))

    @torch.no_grad()
    def set(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(model_v.to(device=ema_v.device, dtype=ema_v.dtype))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def ema_state_for_checkpoint(ema: ModelEmaV3, fp16: bool = True):
    """Compact copy of the EMA weights for the checkpoint (half the size on disk)."""
    state = OrderedDict()
    for k, v in ema.module.state_dict().items():
        state[k] = v.detach().half() if (fp16 and v.is_floating_point()) else v.detach()
    return state


@torch.no_grad()
def ema_distance(ema: ModelEmaV3, model: nn.Module) -> float:
    """Relative L2 distance between the EMA and the live weights (logged every epoch)."""
    num = torch.zeros((), dtype=torch.float32)
    den = torch.zeros((), dtype=torch.float32)
    for e, p in zip(ema.module.parameters(), model.parameters()):
        e32, p32 = e.detach().float().cpu(), p.detach().float().cpu()
        num += (e32 - p32).pow(2).sum()
        den += p32.pow(2).sum()
    return float(num.sqrt() / (den.sqrt() + 1e-12))


def resolve_amp(amp_dtype: str, device: str = "cuda"):
    """Returns (autocast context factory, loss scaler or None)."""
    if amp_dtype in ("float16", "fp16"):
        return partial(torch.autocast, device_type=device, dtype=torch.float16), NativeScaler(device)
    if amp_dtype in ("bfloat16", "bf16"):
        return partial(torch.autocast, device_type=device, dtype=torch.bfloat16), None
    return suppress, None


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, amp_autocast=suppress, loss_scaler=None,
                    model_ema: Optional[ModelEmaV3] = None, clip_grad=None, clip_mode="norm",
                    lr_scheduler=None, log_interval=50, device="cuda"):
    model.train()
    num_updates = epoch * len(loader)
    loss_sum, n = 0.0, 0
    for batch_idx, (input, target) in enumerate(loader):
        input, target = input.to(device, non_blocking=True), target.to(device, non_blocking=True)
        input = input.contiguous(memory_format=torch.channels_last)

        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)

        optimizer.zero_grad(set_to_none=True)
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=clip_grad, clip_mode=clip_mode,
                        parameters=model.parameters(), create_graph=False)
        else:
            loss.backward()
            if clip_grad is not None:
                dispatch_clip_grad(model.parameters(), clip_grad, mode=clip_mode)
            optimizer.step()

        num_updates += 1
        if model_ema is not None:
            model_ema.update(model, step=num_updates)
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates)
        loss_sum += loss.item() * input.size(0)
        n += input.size(0)
        if batch_idx % log_interval == 0:
            _logger.info("Train: %d [%d/%d] loss %.4f lr %.3e", epoch, batch_idx, len(loader),
                         loss_sum / max(n, 1), optimizer.param_groups[0]["lr"])
    return OrderedDict([("loss", loss_sum / max(n, 1))])


class SWAHelper:
    """Stochastic weight averaging over the last ``swa_epochs`` epochs."""

    def __init__(self, model: nn.Module, optimizer, swa_lr: float, anneal_epochs: int = 5):
        self.swa_model = AveragedModel(model)
        self.swa_scheduler = SWALR(optimizer, swa_lr=swa_lr, anneal_epochs=anneal_epochs,
                                   anneal_strategy="cos")
        self.n_averaged = 0

    def update(self, model):
        self.swa_model.update_parameters(model)
        self.n_averaged += 1

    @torch.no_grad()
    def update_bn(self, loader, device="cuda"):
        torch.optim.swa_utils.update_bn(
            (x.to(device, non_blocking=True) for x, _ in loader), self.swa_model, device=device
        )

    def state_dict_half(self):
        return {k: v.half() for k, v in self.swa_model.module.state_dict().items() if v.is_floating_point()}


def swa_finetune_epoch(model, swa: SWAHelper, loader, optimizer, criterion, scaler,
                       device="cuda", amp_dtype=torch.float16):
    """One epoch of the SWA phase: constant/annealed LR, average after every epoch."""
    model.train()
    total, count = 0.0, 0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=amp_dtype):
            logits = model(images)
            loss = criterion(logits, targets)
        total += loss.item() * images.size(0)
        count += images.size(0)
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
    swa.update(model)
    swa.swa_scheduler.step()
    return total / max(count, 1)
