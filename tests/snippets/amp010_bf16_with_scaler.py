"""AMP010 scaler-dtype-mismatch, second half: a GradScaler used with bf16 autocast.

Reported on the GradScaler construction (the line to delete), when every function that scales
a backward with it runs bf16 autocast: ``module_scaler`` also serves fp16 code below.
"""
import functools

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


# ---- regions of the helpers a loss comes from; scalers passed as arguments ---------------
@torch.autocast("cuda", dtype=torch.bfloat16)
def encode_bf16(model, feats):
    return model(feats)


def train_through_bf16_encoder(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")  # AMP010
    for feats, targets in loader:
        logits = encode_bf16(model, feats)
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def scaler_built_enabled_on_one_path(model, batch, optimizer, use_amp):
    """Each construction is judged by itself: on the ``use_amp`` path an enabled scaler
    scales a bf16 loss."""
    if use_amp:
        scaler = torch.amp.GradScaler("cuda")  # AMP010
    else:
        scaler = torch.amp.GradScaler("cuda", enabled=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def bf16_epoch(model, loader, optimizer, scaler):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def run_bf16_epochs(model, loader, optimizer, epochs):
    scaler = torch.amp.GradScaler("cuda")  # AMP010
    for _ in range(epochs):
        bf16_epoch(model, loader, optimizer, scaler)


def encoder_epoch(model, loader, optimizer, grad_scaler):
    for feats, targets in loader:
        logits = encode_bf16(model, feats)
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        grad_scaler.scale(loss).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()


def run_encoder_epochs(model, loader, optimizer, epochs):
    grad_scaler = torch.amp.GradScaler("cuda")  # AMP010
    for _ in range(epochs):
        encoder_epoch(model, loader, optimizer, grad_scaler)


def fp16_epoch(model, loader, optimizer, scaler):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def run_bf16_then_fp16_epochs(model, loader, optimizer):
    """The same scaler also serves fp16 code: it is needed."""
    scaler = torch.amp.GradScaler("cuda")
    bf16_epoch(model, loader, optimizer, scaler)
    fp16_epoch(model, loader, optimizer, scaler)


def run_bf16_epochs_scaler_by_flag(model, loader, optimizer, use_amp):
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    bf16_epoch(model, loader, optimizer, scaler)


def external_forward_epoch(model, loader, optimizer, scaler, forward_step):
    """The loss comes from code elsewhere, under an autocast not seen here."""
    for batch in loader:
        loss = forward_step(model, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def run_bf16_and_external_epochs(model, loader, optimizer, forward_step):
    scaler = torch.amp.GradScaler("cuda")
    bf16_epoch(model, loader, optimizer, scaler)
    external_forward_epoch(model, loader, optimizer, scaler, forward_step)


def fp16_loss_beside_a_bf16_probe(model, loader, optimizer, log):
    """The bf16 helper's result is only logged: the loss is computed in fp16."""
    scaler = torch.amp.GradScaler("cuda")
    for feats in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(feats)
        log(encode_bf16(model, feats).norm())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def library_bf16_step(model, batch, optimizer, lib_scaler):
    """A scaler parameter with no call site in this file: nothing here builds it."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    lib_scaler.scale(loss).backward()
    lib_scaler.step(optimizer)
    lib_scaler.update()


# ---- one flag switches both: whenever the scaler is on, the autocast is bf16 --------------
def kaggle_train_fn(model, loader, optimizer, scaler, cfg):
    for images, labels in loader:
        with torch.autocast("cuda", enabled=cfg["apex"], dtype=torch.bfloat16):
            loss = model(images, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def kaggle_main(model, loader, optimizer, cfg):
    scaler = torch.amp.GradScaler("cuda", enabled=cfg["apex"])  # AMP010
    kaggle_train_fn(model, loader, optimizer, scaler, cfg)


def different_flags_train_fn(model, loader, optimizer, scaler, cfg):
    for images, labels in loader:
        with torch.autocast("cuda", enabled=cfg["bf16"], dtype=torch.bfloat16):
            loss = model(images, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def different_flags_main(model, loader, optimizer, cfg):
    scaler = torch.amp.GradScaler("cuda", enabled=cfg["fp16"])
    different_flags_train_fn(model, loader, optimizer, scaler, cfg)


class TabularTrainer:
    def __init__(self, cfg, model):
        self.cfg, self.model = cfg, model
        self.optimizer = torch.optim.AdamW(model.parameters())
        self.scaler = torch.amp.GradScaler("cpu", enabled=cfg.amp)  # AMP010

    def train_step(self, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.amp):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()


class DiffWaveLearner:
    def __init__(self, model, optimizer, params):
        self.model, self.optimizer = model, optimizer
        self.autocast = functools.partial(
            torch.autocast, device_type="cuda", dtype=torch.bfloat16, enabled=params.use_amp
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=params.use_amp)  # AMP010

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_step(self, audio, t):
        with self.autocast():
            loss = self.model(audio, t).float().abs().mean()
        self.backward(loss)
        self.step()
