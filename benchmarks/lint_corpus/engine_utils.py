"""Training engine helpers shared by several experiment scripts."""
import contextlib
import functools
import logging

import torch
from packaging import version

logger = logging.getLogger(__name__)

try:
    from torch.amp import GradScaler as _GradScaler

    def new_scaler(enabled=True):
        return _GradScaler("cuda", enabled=enabled)
except ImportError:
    from torch.cuda.amp import GradScaler as _GradScaler

    def new_scaler(enabled=True):
        return _GradScaler(enabled=enabled)


if version.parse(torch.__version__) >= version.parse("2.4"):
    autocast_fn = functools.partial(torch.amp.autocast, "cuda")
else:
    autocast_fn = torch.cuda.amp.autocast


def is_amp_scaler(obj):
    """Recognise scalers of both APIs (checkpoint loading code sees both)."""
    return isinstance(obj, (torch.amp.GradScaler, torch.cuda.amp.GradScaler))


def train_one_epoch(model, loader, optimizer, criterion, scaler=torch.cuda.amp.GradScaler()):  # expect: AMP009
    model.train()
    for x, y in loader:
        with autocast_fn():
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


class Engine:
    def __init__(self, model, optimizer, amp_ctx=torch.cuda.amp.autocast, grad_scaler=None):  # expect: AMP009
        self.model = model
        self.optimizer = optimizer
        self.amp_ctx = amp_ctx
        self.scaler = grad_scaler if grad_scaler is not None else new_scaler()

    def step(self, x, y, criterion):
        with self.amp_ctx():
            loss = criterion(self.model(x), y)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()


def build_engine(model, optimizer):
    return Engine(model, optimizer, grad_scaler=torch.cuda.amp.GradScaler(init_scale=2.0 ** 12))  # expect: AMP009


def build_engine_modern(model, optimizer):
    return Engine(model, optimizer, amp_ctx=functools.partial(torch.amp.autocast, "cuda"),
                  grad_scaler=torch.amp.GradScaler("cuda"))


def npu_context():
    return torch.npu.amp.autocast() if hasattr(torch, "npu") else contextlib.nullcontext()


@torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
def fp32_only_op(x):
    return torch.linalg.eigvalsh(x)
