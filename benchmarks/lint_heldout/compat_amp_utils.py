"""AMP helpers shared by the CPU and GPU training entry points of our toolkit."""
import functools
from contextlib import nullcontext

import torch
from torch.cuda import amp

from .logging import get_logger

logger = get_logger(__name__)

_TORCH_GE_23 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 3)


def build_grad_scaler(enabled: bool = True):
    """Returns a GradScaler; on torch < 2.3 falls back to torch.cuda.amp.GradScaler."""
    if _TORCH_GE_23:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def build_autocast(device: str, dtype: torch.dtype):
    try:
        return torch.amp.autocast(device_type=device, dtype=dtype)
    except (AttributeError, TypeError):
        return torch.cuda.amp.autocast(dtype=dtype)


cpu_bf16_autocast = functools.partial(torch.cpu.amp.autocast, dtype=torch.bfloat16)  # expect: AMP009


def npu_autocast():
    import torch_npu  # noqa: F401  (Ascend)
    return torch.npu.amp.autocast()


def train_cpu(model, loader, optimizer, epochs=1):
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            with cpu_bf16_autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def train_gpu(model, loader, optimizer, scaler=amp.GradScaler(), clip=None):  # expect: AMP009
    model.train()
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        with amp.autocast():  # expect: AMP009
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()


def eval_gpu(model, loader, half=False):
    model.eval()
    ctx = torch.cuda.amp.autocast() if half else nullcontext()  # expect: AMP009
    correct = 0
    with torch.no_grad(), ctx:
        for x, y in loader:
            correct += (model(x.cuda()).argmax(-1) == y.cuda()).sum().item()
    return correct


def describe():
    """Mixed precision uses torch.cuda.amp.autocast on old versions (see build_autocast)."""
    logger.info("amp: %s", "torch.amp" if _TORCH_GE_23 else "torch.cuda.amp")
