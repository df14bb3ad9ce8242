"""Transformer translation training with label smoothing, gradient accumulation and AMP."""
import math
import time

import torch
import torch.nn as nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_


class LabelSmoothingLoss(nn.Module):
    def __init__(self, smoothing, vocab_size, ignore_index=0):
        super().__init__()
        self.smoothing = smoothing
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index

    def forward(self, logits, target):
        log_probs = logits.float().log_softmax(dim=-1)
        nll = -log_probs.gather(dim=-1, index=target.unsqueeze(-1)).squeeze(-1)
        smooth = -log_probs.mean(dim=-1)
        loss = (1.0 - self.smoothing) * nll + self.smoothing * smooth
        return loss.masked_fill(target == self.ignore_index, 0.0).sum()


class Trainer:
    def __init__(self, model, optimizer, cfg):
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.criterion = LabelSmoothingLoss(cfg.smoothing, cfg.vocab_size)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
        self.step_num = 0

    def _clip(self):
        if self.cfg.clip_value:
            clip_grad_value_(self.model.parameters(), self.cfg.clip_value)
        return clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)

    def train_epoch(self, batches):
        self.model.train()
        start = time.time()
        total_tokens = 0
        for i, (src, tgt) in enumerate(batches):
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(src, tgt[:, :-1])
                loss = self.criterion(logits, tgt[:, 1:])
            ntokens = (tgt[:, 1:] != 0).sum().item()
            self.scaler.scale(loss / ntokens / self.cfg.accum).backward()
            total_tokens += ntokens
            if (i + 1) % self.cfg.accum == 0:
                grad_norm = self._clip()  # expect: AMP005
                if not math.isfinite(grad_norm):
                    print(f"step {self.step_num}: non-finite grad norm")
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.step_num += 1
        return total_tokens / (time.time() - start)

    def train_epoch_value_clip(self, batches):
        for src, tgt in batches:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.criterion(self.model(src, tgt[:, :-1]), tgt[:, 1:])
            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            clip_grad_value_(self.model.parameters(), 5.0)  # expect: AMP005
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def train_epoch_correct(self, batches):
        for src, tgt in batches:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.criterion(self.model(src, tgt[:, :-1]), tgt[:, 1:])
            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()


def train_script(model, optimizer, batches, clip=1.0, accum=4):
    scaler = torch.amp.GradScaler("cuda")
    criterion = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    for i, (src, tgt) in enumerate(batches):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(src, tgt[:, :-1])
            loss = criterion(out.reshape(-1, out.size(-1)), tgt[:, 1:].reshape(-1)) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
