"""Contrastive speech pretraining loop (wav2vec-style) with gradient accumulation."""
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator


def compute_contrastive_logits(target, negatives, transformed, temperature=0.1):
    targets = torch.cat([target, negatives], dim=0)
    logits = torch.cosine_similarity(transformed.float(), targets.float(), dim=-1).type_as(targets)
    return logits / temperature


def gumbel_temperature(step, max_temp=2.0, min_temp=0.5, decay=0.999995):
    return max(max_temp * decay ** step, min_temp)


class Pretrainer:
    def __init__(self, model, optimizer, scheduler, cfg):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = cfg
        self.scaler = torch.amp.GradScaler("cuda")
        self.amp_ctx = torch.autocast("cuda", dtype=torch.float16) if cfg.fp16 else nullcontext()

    def train_epoch(self, loader, step):
        self.model.train()
        for i, batch in enumerate(loader):
            with self.amp_ctx:
                outputs = self.model(batch["input_values"], mask_time_indices=batch["mask"])
                loss = outputs.loss / self.cfg.accum
                self.scaler.scale(loss).backward()  # expect: AMP008
            if (i + 1) % self.cfg.accum == 0:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad()
                self.scheduler.step()
                step += 1
                self.model.set_gumbel_temperature(gumbel_temperature(step))
        return step

    def train_epoch_fixed(self, loader, step):
        self.model.train()
        for i, batch in enumerate(loader):
            with self.amp_ctx:
                outputs = self.model(batch["input_values"], mask_time_indices=batch["mask"])
                loss = outputs.loss / self.cfg.accum
            self.scaler.scale(loss).backward()
            if (i + 1) % self.cfg.accum == 0:
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad()
        return step


def pretrain_with_accelerate(model, optimizer, loader, epochs=1):
    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for batch in loader:
            with accelerator.autocast():
                loss = model(**batch).loss
                accelerator.backward(loss)  # expect: AMP008
            optimizer.step()
            optimizer.zero_grad()


def probe_gradients(model, batch):
    """Debug helper: per-layer gradient norms of one batch under fp16 autocast."""
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(**batch).loss
        torch.autograd.backward(loss * 1024.0)  # expect: AMP008
    return {n: p.grad.float().norm().item() / 1024.0 for n, p in model.named_parameters() if p.grad is not None}


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, n = 0.0, 0
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            total += model(**batch).loss.item()
        n += 1
    return math.exp(total / max(n, 1))


def linear_probe(encoder, probe, loader, optimizer):
    encoder.eval()
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            with torch.no_grad():
                feats = encoder(x).last_hidden_state.mean(1)
            logits = probe(feats)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
