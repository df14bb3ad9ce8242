"""Supervised fine-tuning of a decoder-only model on instruction data."""
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader


@dataclass
class SFTConfig:
    lr: float = 2e-5
    warmup: int = 100
    epochs: int = 3
    grad_accum: int = 8
    max_grad_norm: float = 1.0
    out_dir: str = "sft-out"


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


def masked_lm_loss(logits, labels):
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


class SFTTrainer:
    def __init__(self, model, tokenizer, dataset, cfg: SFTConfig):
        self.model = model.cuda()
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.loader = DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=self.collate)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                                           betas=(0.9, 0.95))
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        self.total_steps = cfg.epochs * len(self.loader) // cfg.grad_accum

    def collate(self, examples):
        ids = [torch.tensor(e["input_ids"]) for e in examples]
        labels = [torch.tensor(e["labels"]) for e in examples]
        ids = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=self.tokenizer.pad_token_id)
        labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)
        return ids, labels

    def train(self):
        step = 0
        self.model.train()
        for epoch in range(self.cfg.epochs):
            for i, (ids, labels) in enumerate(self.loader):
                ids, labels = ids.cuda(non_blocking=True), labels.cuda(non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = self.model(ids).logits
                    loss = masked_lm_loss(logits, labels) / self.cfg.grad_accum
                self.scaler.scale(loss).backward()
                if (i + 1) % self.cfg.grad_accum:
                    continue
                for group in self.optimizer.param_groups:
                    group["lr"] = cosine_lr(step, self.total_steps, self.cfg.warmup, self.cfg.lr)
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                step += 1
            self.save(os.path.join(self.cfg.out_dir, f"epoch{epoch}"))

    def save(self, path):
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


class DPOTrainer:
    """Preference optimisation against a frozen reference copy of the policy."""

    def __init__(self, policy, reference, beta=0.1, lr=5e-7):
        self.policy = policy
        self.reference = reference.to(torch.bfloat16).eval()
        self.reference.requires_grad_(False)
        self.beta = beta
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)

    @staticmethod
    def sequence_logps(logits, labels):
        logps = torch.log_softmax(logits.float(), dim=-1)
        mask = labels != -100
        per_token = torch.gather(logps, 2, labels.clamp(min=0).unsqueeze(2)).squeeze(2)
        return (per_token * mask).sum(-1)

    def step(self, chosen, chosen_labels, rejected, rejected_labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pc = self.sequence_logps(self.policy(chosen).logits, chosen_labels)
            pr = self.sequence_logps(self.policy(rejected).logits, rejected_labels)
            with torch.no_grad():
                rc = self.sequence_logps(self.reference(chosen).logits, chosen_labels)
                rr = self.sequence_logps(self.reference(rejected).logits, rejected_labels)
            loss = -F.logsigmoid(self.beta * ((pc - rc) - (pr - rr))).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.optimizer.step()
        return loss.item()
