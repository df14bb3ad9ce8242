"""Instruction tuning with an auxiliary response-quality head and a KL anchor.

    python lm_finetune.py --config configs/sft_7b.yaml

Stage 0 (optional) fits a small quality classifier that is used to filter the SFT
mixture.  Stage 1 tunes the policy LM on the filtered data with three terms: the
LM loss, a KL term towards the frozen reference model, and a 3-way quality
classification head on attention-pooled hidden states.  The LM and quality terms
are balanced with learned homoscedastic-uncertainty weights (Kendall et al., 2018).

This replaces the old loop that used ``torch.cuda.amp.autocast`` and a separate
fp32 value model.
"""
import argparse
import copy
import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from sft.data import build_pref_loader, build_sft_loader, filter_by_quality

logger = logging.getLogger(__name__)


@dataclass
class FinetuneConfig:
    model_name: str = "meta-llama/Llama-2-7b-hf"
    classifier_name: str = "microsoft/deberta-v3-base"
    precision: str = "bf16"
    lr: float = 1e-5
    weight_decay: float = 0.0
    loss_weight_lr: float = 1e-3
    kl_coef: float = 0.05
    num_quality_labels: int = 3
    grad_accum: int = 8
    max_grad_norm: float = 1.0
    epochs: int = 2
    classifier_epochs: int = 0
    classifier_lr: float = 2e-5
    output_dir: str = "out/sft"
    log_every: int = 10
    save_every: int = 500
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, path):
        with open(path) as f:
            raw = yaml.safe_load(f)
        known = {k: raw.pop(k) for k in list(raw) if k in cls.__dataclass_fields__}
        return cls(**known, extra=raw)


class AttentionPoolingHead(nn.Module):
    def __init__(self, hidden_size: int, num_labels: int, dropout: float = 0.1):
        super().__init__()
        self.score = nn.Linear(hidden_size, 1)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden, attention_mask):
        scores = self.score(hidden).squeeze(-1)
        scores = scores.masked_fill(attention_mask == 0, -1e9)  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        pooled = torch.einsum("bt,bth->bh", weights.to(hidden.dtype), hidden)
        return self.out(self.dropout(pooled))


class LMWithQualityHead(nn.Module):
    def __init__(self, lm, num_labels: int):
        super().__init__()
        self.lm = lm
        self.head = AttentionPoolingHead(lm.config.hidden_size, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True)
        quality_logits = self.head(out.hidden_states[-1], attention_mask)
        return out, quality_logits


def kl_penalty(logits, ref_logits, mask):
    """Token-level KL(policy || reference), averaged over non-padding tokens."""
    logp = F.log_softmax(logits.float(), dim=-1)
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    kl = (logp.exp() * (logp - ref_logp)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def train_quality_classifier(cfg: FinetuneConfig, loader):
    """Stage 0: small classifier used to drop low-quality SFT examples."""
    model = AutoModelForSequenceClassification.from_pretrained(cfg.classifier_name, num_labels=cfg.num_quality_labels, torch_dtype=torch.float16)  # expect: AMP001
    model.to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.classifier_lr, weight_decay=0.01)  # expect: AMP011
    model.train()
    for epoch in range(cfg.classifier_epochs):
        for step, batch in enumerate(loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = F.cross_entropy(logits.float(), batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % cfg.log_every == 0:
                logger.info("[classifier] epoch %d step %d loss %.4f", epoch, step, loss.item())
    model.eval()
    return model


def load_policy(cfg: FinetuneConfig):
    lm = AutoModelForCausalLM.from_pretrained(cfg.model_name, torch_dtype=torch.float32)
    lm.gradient_checkpointing_enable()
    return LMWithQualityHead(lm, cfg.num_quality_labels)


def load_reference(cfg: FinetuneConfig):
    ref = AutoModelForCausalLM.from_pretrained(cfg.model_name, torch_dtype=torch.float16)
    ref.requires_grad_(False)
    return ref.eval()


def configure_optimizer(model: nn.Module, cfg: FinetuneConfig):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=torch.cuda.is_available())


class LMTrainer:
    def __init__(self, model, ref_model, optimizer, cfg: FinetuneConfig, train_loader, hooks: Optional[List] = None):
        self.cfg = cfg
        self.device = torch.device("cuda")
        self.model = model.to(self.device)
        self.ref_model = ref_model.to(self.device)
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.hooks = hooks or []
        amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.precision)
        self.autocast_ctx = functools.partial(torch.autocast, device_type="cuda", dtype=amp_dtype,
                                              enabled=amp_dtype is not None)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
        # log-variances of the LM and quality terms
        self.log_vars = nn.Parameter(torch.zeros(2, device=self.device))
        self.weight_opt = torch.optim.SGD([self.log_vars], lr=cfg.loss_weight_lr)
        self.micro_step = 0
        self.global_step = 0

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self, batch):
        batch = self._to_device(batch)
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad(), self.autocast_ctx():
            ref_logits = self.ref_model(input_ids=input_ids, attention_mask=attention_mask).logits
        with self.autocast_ctx():
            outputs, quality_logits = self.model(input_ids, attention_mask=attention_mask, labels=batch["labels"])
        lm_loss = outputs.loss
        kl = kl_penalty(outputs.logits, ref_logits, attention_mask)
        quality_loss = F.cross_entropy(quality_logits, batch["quality"])  # expect: AMP002
        inv_var = torch.exp(-self.log_vars)
        loss = (inv_var[0] * (lm_loss + self.cfg.kl_coef * kl) + inv_var[1] * quality_loss
                + self.log_vars.sum())

        self.scaler.scale(loss / self.cfg.grad_accum).backward()
        self.micro_step += 1
        logs = {"loss": loss.item(), "lm": lm_loss.item(), "kl": kl.item(), "quality": quality_loss.item()}
        if self.micro_step % self.cfg.grad_accum == 0:
            self.scaler.unscale_(self.optimizer)
            logs["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm).item()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.weight_opt.step()  # expect: AMP006
            self.optimizer.zero_grad(set_to_none=True)
            self.weight_opt.zero_grad(set_to_none=True)
            self.global_step += 1
        return logs

    def benchmark(self, batch, steps: int = 20):
        """Time forward+backward and report peak memory; leaves the optimizer untouched."""
        batch = self._to_device(batch)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            with self.autocast_ctx():
                outputs, _ = self.model(batch["input_ids"], attention_mask=batch["attention_mask"],
                                        labels=batch["labels"])
                outputs.loss.backward()  # expect: AMP008
            self.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return {"step_time_s": (time.perf_counter() - t0) / steps,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30}

    def save(self, tag):
        path = os.path.join(self.cfg.output_dir, f"{tag}.pt")
        torch.save({
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "log_vars": self.log_vars.detach().cpu(),
            "weight_opt": self.weight_opt.state_dict(),
            "global_step": self.global_step,
        }, path)

    def fit(self):
        self.model.train()
        best = math.inf
        for epoch in range(self.cfg.epochs):
            for batch in self.train_loader:
                logs = self.train_step(batch)
                if self.micro_step % self.cfg.grad_accum:
                    continue
                for hook in self.hooks:
                    hook(self, logs)
                if self.global_step % self.cfg.log_every == 0:
                    logger.info("epoch %d step %d %s", epoch, self.global_step,
                                " ".join(f"{k}={v:.4f}" for k, v in logs.items()))
                if self.global_step % self.cfg.save_every == 0:
                    self.save("latest")
                if logs["lm"] < best:
                    best = logs["lm"]
        self.save("final")


def export_for_serving(model: LMWithQualityHead, tokenizer, out_dir: str):
    lm = copy.deepcopy(model.lm).half()
    lm.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    torch.save(model.head.state_dict(), os.path.join(out_dir, "quality_head.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--benchmark", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    cfg = FinetuneConfig.from_yaml(args.config)
    os.makedirs(cfg.output_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    train_loader = build_sft_loader(cfg, tokenizer)
    if cfg.classifier_epochs > 0:
        classifier = train_quality_classifier(cfg, build_pref_loader(cfg))
        train_loader = filter_by_quality(train_loader, classifier, min_label=1)

    policy = load_policy(cfg)
    ref = load_reference(cfg)
    optimizer = configure_optimizer(policy, cfg)
    trainer = LMTrainer(policy, ref, optimizer, cfg, train_loader)
    if args.benchmark:
        print(trainer.benchmark(next(iter(train_loader))))
        return
    trainer.fit()
    export_for_serving(policy, tokenizer, os.path.join(cfg.output_dir, "hf"))


if __name__ == "__main__":
    main()
