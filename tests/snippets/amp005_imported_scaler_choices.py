"""AMP005 with the GradScaler class imported in a version gate or a vendor dispatch: each
import gives a GradScaler, so the scaler kept on ``self`` is one, and the clip in another
method sees scaled gradients."""
import torch
from torch.nn.utils import clip_grad_norm_

from mylib.device import is_npu_available

try:
    from torch.amp import GradScaler
except ImportError:
    from torch.cuda.amp import GradScaler

if is_npu_available():
    from torch.npu.amp import GradScaler as DeviceScaler
else:
    from torch.amp import GradScaler as DeviceScaler

if is_npu_available():
    from mylib.npu import LossScaler
else:
    from torch.amp import GradScaler as LossScaler


class AmpOptimWrapper:
    def __init__(self, optimizer, max_norm):
        self.optimizer, self.max_norm = optimizer, max_norm
        self.loss_scaler = GradScaler()

    def backward(self, loss):
        self.loss_scaler.scale(loss).backward()

    def step(self):
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, self.max_norm)  # AMP005
        self.loss_scaler.step(self.optimizer)
        self.loss_scaler.update()


class DeviceOptimWrapper(AmpOptimWrapper):
    def __init__(self, optimizer, max_norm):
        super().__init__(optimizer, max_norm)
        self.loss_scaler = DeviceScaler()


class UnscalingWrapper:
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.loss_scaler = DeviceScaler()

    def backward(self, loss):
        self.loss_scaler.scale(loss).backward()

    def step(self):
        self.loss_scaler.unscale_(self.optimizer)
        clip_grad_norm_(self.optimizer.param_groups[0]["params"], 1.0)
        self.loss_scaler.step(self.optimizer)
        self.loss_scaler.update()


class MaybeForeignScalerWrapper:
    """One import gives a class from elsewhere, which may unscale in its own ``scale``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.loss_scaler = LossScaler()

    def backward(self, loss):
        self.loss_scaler.scale(loss).backward()

    def step(self):
        clip_grad_norm_(self.optimizer.param_groups[0]["params"], 1.0)
        self.loss_scaler.step(self.optimizer)
        self.loss_scaler.update()
