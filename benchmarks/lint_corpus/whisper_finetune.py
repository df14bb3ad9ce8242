"""Fine-tune a speech-to-text encoder-decoder with SpecAugment, label smoothing and AMP."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def spec_augment(mel, F_=27, T_=100, n_freq=2, n_time=2):
    mel = mel.clone()
    for _ in range(n_freq):
        f = torch.randint(0, F_, (1,)).item()
        f0 = torch.randint(0, mel.size(1) - f, (1,)).item()
        mel[:, f0 : f0 + f] = mel.mean()
    for _ in range(n_time):
        t = torch.randint(0, T_, (1,)).item()
        t0 = torch.randint(0, max(1, mel.size(2) - t), (1,)).item()
        mel[:, :, t0 : t0 + t] = mel.mean()
    return mel


def smoothed_nll(log_probs, target, eps=0.1, ignore_index=-100):
    mask = target != ignore_index
    target = target.masked_fill(~mask, 0)
    nll = -log_probs.gather(-1, target[..., None]).squeeze(-1)
    smooth = -log_probs.mean(-1)
    loss = (1 - eps) * nll + eps * smooth
    return (loss * mask).sum() / mask.sum()


class SpeechTrainer:
    def __init__(self, model, tokenizer, cfg):
        self.model = model.cuda()
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.fp16)
        self.step = 0

    def lr_at(self, step):
        warmup = self.cfg.warmup
        return self.cfg.lr * min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / self.cfg.total)))

    def train_step(self, mel, tokens):
        mel = spec_augment(mel.cuda())
        tokens = tokens.cuda()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.fp16):
            logits = self.model(mel, tokens[:, :-1])
        log_probs = F.log_softmax(logits, dim=-1)
        loss = smoothed_nll(log_probs, tokens[:, 1:])  # expect: AMP002
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        return loss.item()

    def train_step_fp32_head(self, mel, tokens):
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.fp16):
            logits = self.model(mel.cuda(), tokens[:, :-1].cuda())
        log_probs = F.log_softmax(logits.float(), dim=-1)
        loss = smoothed_nll(log_probs, tokens[:, 1:].cuda())
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    @torch.no_grad()
    def greedy_decode(self, mel, max_len=224):
        self.model.eval()
        tokens = torch.full((mel.size(0), 1), self.tokenizer.sot, device="cuda")
        for _ in range(max_len):
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(mel.cuda(), tokens)[:, -1]
            logits[:, self.tokenizer.no_timestamps] = -float("inf")
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
            if (tokens[:, -1] == self.tokenizer.eot).all():
                break
        self.model.train()
        return tokens
