"""Precision selection for the pretraining launcher (uses `match`, Python 3.10+)."""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch as th
import torch.nn.functional as F
from torch import autocast as ac

HALF = th.float16
BF16 = th.bfloat16


def precision_context(precision: str) -> Callable[[], ContextManager]:
    match precision:
        case "fp16":
            return lambda: ac("cuda", dtype=HALF)
        case "bf16":
            return lambda: ac("cuda", dtype=BF16)
        case _:
            return contextlib.nullcontext


def step_fp16_no_scaler(model, batch, optimizer):
    """Used by the quick-check mode: fp16 autocast, but nobody added a scaler."""
    with ac("cuda", dtype=HALF):  # expect: AMP010
        out = model(batch["x"])
        loss = F.mse_loss(out, batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def step_bf16(model, batch, optimizer):
    with ac("cuda", dtype=BF16):
        out = model(batch["x"])
        loss = F.mse_loss(out, batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def make_scaler(precision: str) -> th.amp.GradScaler:
    return th.amp.GradScaler("cuda", enabled=precision == "fp16")


def run(model, loader, optimizer, precision: str = "bf16") -> None:
    ctx = precision_context(precision)
    scaler = make_scaler(precision)
    for step, batch in enumerate(loader):
        with ctx():
            if (loss := model(**batch).loss) is None:
                continue
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        th.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"{step=} {loss.item()=:.4f}")


def cast_batch(batch: dict, model) -> dict:
    """Inputs follow the model's dtype (the model may be an fp16 export)."""
    dtype = next(model.parameters()).dtype
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def finetune_low_memory(model, loader, lr: float = 1e-5) -> None:
    """"Low memory" mode someone added: the whole model in bf16, AdamW over bf16 weights."""
    model = model.to(device="cuda", dtype=BF16)  # expect: AMP001
    optimizer = th.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for batch in loader:
        loss = model(**{k: v.cuda() for k, v in batch.items()}).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
