"""A small training framework: a base trainer, AMP and clipping mixins, and two concrete trainers."""
import logging

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


class BaseTrainer:
    def __init__(self, model, optimizer, max_norm=None):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.step_count = 0

    def compute_loss(self, batch):
        raise NotImplementedError

    def train_step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.compute_loss(batch)
        loss.backward()
        if self.max_norm:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        self.step_count += 1
        return loss.detach()


class AmpTrainer(BaseTrainer):
    def __init__(self, model, optimizer, max_norm=None):
        super().__init__(model, optimizer, max_norm)
        self.scaler = torch.amp.GradScaler("cuda")

    def train_step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.compute_loss(batch)
        self.scaler.scale(loss).backward()
        if self.max_norm:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step_count += 1
        return loss.detach()


class AccumulatingAmpTrainer(AmpTrainer):
    def __init__(self, model, optimizer, accum=4, max_norm=1.0):
        super().__init__(model, optimizer, max_norm)
        self.accum = accum

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.compute_loss(batch) / self.accum
        self.scaler.scale(loss).backward()
        self.step_count += 1
        if self.step_count % self.accum == 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach() * self.accum


class ClassifierTrainer(AccumulatingAmpTrainer):
    def __init__(self, model, optimizer, criterion):
        super().__init__(model, optimizer)
        self.criterion = criterion

    def compute_loss(self, batch):
        x, y = batch
        return self.criterion(self.model(x.cuda(non_blocking=True)), y.cuda(non_blocking=True))


class TwoStageTrainer(AmpTrainer):
    """First stage trains the encoder with the scaler; second stage forgets to step through it."""

    def train_encoder(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.compute_loss(batch)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_head(self, batch, head_optimizer):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.compute_loss(batch)
        head_optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        head_optimizer.step()  # expect: AMP006
