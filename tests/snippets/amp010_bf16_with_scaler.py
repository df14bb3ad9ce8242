"""AMP010 scaler-dtype-mismatch, second half: a GradScaler used with bf16 autocast.

Reported on the GradScaler construction (the line to delete), when every function that scales
a backward with it runs bf16 autocast: ``module_scaler`` also serves fp16 code below.
"""
import torch
from torch.amp import GradScaler

module_scaler = torch.amp.GradScaler("cuda")


# ---------------------------------------------------------------- positives


def local_scaler_bf16(model, batch, optimizer):
    scaler = torch.amp.GradScaler("cuda")  # AMP010
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def enabled_literal_true(model, batch, optimizer):
    scaler = GradScaler("cuda", enabled=True)  # AMP010
    with torch.amp.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def module_level_scaler(model, batch, optimizer):
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        loss = model(batch)
    module_scaler.scale(loss).backward()
    module_scaler.step(optimizer)
    module_scaler.update()


def cpu_default_bf16(model, batch, optimizer):
    scaler = torch.amp.GradScaler("cpu")  # AMP010
    with torch.autocast("cpu"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


class Trainer:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")  # AMP010

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()


def in_loop(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")  # AMP010
    for batch in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# ---------------------------------------------------------------- negatives


def scaler_with_fp16(model, batch, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def disabled_scaler_with_bf16(model, batch, optimizer):
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def scaler_enabled_by_dtype(model, batch, optimizer, dtype):
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == "float16")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def scaler_parameter_of_unknown_state(model, batch, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def bf16_function_without_scaler(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    loss.backward()
    optimizer.step()


def unknown_dtype(model, batch, optimizer, amp_dtype):
    with torch.autocast("cuda", dtype=amp_dtype):
        loss = model(batch)
    module_scaler.scale(loss).backward()
    module_scaler.step(optimizer)
    module_scaler.update()


def fp16_plain_backward_while_file_has_scaler(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    module_scaler.scale(loss).backward()
    module_scaler.step(optimizer)
    module_scaler.update()


def bf16_eval(model, batch):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return model(batch)
