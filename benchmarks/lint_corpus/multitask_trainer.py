"""Multi-task trainer: shared encoder, per-task heads and optimizers, optional AMP."""
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel

log = logging.getLogger(__name__)


class MultiTaskTrainer:
    def __init__(self, encoder, heads, cfg):
        self.encoder = encoder
        self.heads = nn.ModuleDict(heads)
        self.cfg = cfg
        self.enc_optimizer = torch.optim.AdamW(encoder.parameters(), lr=cfg.lr)
        self.head_optimizers = {k: torch.optim.AdamW(h.parameters(), lr=cfg.head_lr) for k, h in heads.items()}
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.enc_optimizer, cfg.steps)
        self.swa = AveragedModel(encoder)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.amp else None

    def backward(self, loss):
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self):
        if self.scaler is not None:
            self.scaler.step(self.enc_optimizer)
            for opt in self.head_optimizers.values():
                self.scaler.step(opt)
            self.scaler.update()
        else:
            self.enc_optimizer.step()
            for opt in self.head_optimizers.values():
                opt.step()
        self.scheduler.step()
        self.swa.update_parameters(self.encoder)

    def train_batch(self, batch):
        task = batch["task"]
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.scaler is not None):
            feats = self.encoder(batch["x"])
            out = self.heads[task](feats)
            loss = F.cross_entropy(out, batch["y"]) if task != "reg" else F.smooth_l1_loss(out, batch["y"])
        self.enc_optimizer.zero_grad()
        self.head_optimizers[task].zero_grad()
        self.backward(loss)
        self.step()
        return loss.item()


class SimpleAmpTrainer:
    """A second, smaller trainer in the same module: scale in one method, step in another."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.grad_scaler = torch.amp.GradScaler("cuda")

    def forward_backward(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(self.model(x), y)
        self.grad_scaler.scale(loss).backward()
        return loss.detach()

    def optimizer_step(self):
        self.optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)


def train_two_optimizers(model_a, model_b, loader, opt_a, opt_b, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out_a = model_a(x)
            out_b = model_b(x)
            loss_a = F.cross_entropy(out_a, y)
            loss_b = F.cross_entropy(out_b, y) + F.mse_loss(out_b, out_a.detach())
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(loss_a).backward(retain_graph=True)
        scaler.scale(loss_b).backward()
        scaler.unscale_(opt_a)
        nn.utils.clip_grad_norm_(model_a.parameters(), 1.0)
        scaler.step(opt_a)
        opt_b.step()  # expect: AMP006
        scaler.update()


def train_with_ema(model, ema, loader, optimizer, scheduler, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        ema.step()


def train_no_update(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # expect: AMP006
    log.info("final scale %s", scaler.get_scale())
