"""Small fine-tuning trainer shared by the text-classification and captioning recipes.

Config keys (YAML, see configs/*.yaml):
    precision      fp32 | fp16 | bf16
    lr, weight_decay, warmup_steps, max_steps
    grad_accum, max_grad_norm, log_every, eval_every, out_dir
"""
import logging
import math
import os
import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
import yaml
from torch.utils.data import DataLoader

logger = logging.getLogger(__name__)


def linear_warmup_cosine(optimizer, warmup_steps, max_steps, min_ratio=0.1):
    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


class Trainer:
    def __init__(self, model: nn.Module, cfg: Dict[str, Any], train_loader: DataLoader,
                 eval_loader: Optional[DataLoader] = None, compute_metrics: Optional[Callable] = None):
        self.cfg = cfg
        self.device = torch.device(cfg.get("device", "cuda"))
        self.model = model.to(self.device)
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.compute_metrics = compute_metrics
        self.grad_accum = int(cfg.get("grad_accum", 1))
        self.max_grad_norm = float(cfg.get("max_grad_norm", 0.0))
        self.max_steps = int(cfg["max_steps"])
        self.out_dir = cfg.get("out_dir", "outputs")

        self.precision = cfg.get("precision", "fp32")
        self.use_amp = self.precision in ("fp16", "bf16")
        self.amp_dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        self.scaler = torch.cuda.amp.GradScaler(enabled=self.precision == "fp16")  # expect: AMP009

        self.optimizer = self._build_optimizer()
        self.scheduler = linear_warmup_cosine(self.optimizer, int(cfg.get("warmup_steps", 0)), self.max_steps)
        self.global_step = 0

    def _build_optimizer(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim < 2 or name.endswith(".bias") or "norm" in name.lower():
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [
            {"params": decay, "weight_decay": float(self.cfg.get("weight_decay", 0.01))},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=float(self.cfg["lr"]), betas=(0.9, 0.98), eps=1e-8)

    def _to_device(self, batch):
        out = {}
        for k, v in batch.items():
            if not torch.is_tensor(v):
                out[k] = v
            elif v.is_floating_point():
                out[k] = v.to(self.device, non_blocking=True).half()  # expect: AMP001
            else:
                out[k] = v.to(self.device, non_blocking=True)
        return out

    def train_step(self, batch) -> torch.Tensor:
        batch = self._to_device(batch)
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.use_amp):
            outputs = self.model(**batch)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs.loss
            loss = loss / self.grad_accum
            self.scaler.scale(loss).backward()  # expect: AMP008
        return loss.detach()

    def _optimizer_step(self) -> float:
        grad_norm = float("nan")
        if self.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm).item()
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return grad_norm

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        if self.eval_loader is None:
            return {}
        self.model.eval()
        total_loss, n = 0.0, 0
        preds, refs = [], []
        for batch in self.eval_loader:
            batch = self._to_device(batch)
            with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.use_amp):
                outputs = self.model(**batch)
            total_loss += outputs.loss.item()
            n += 1
            if self.compute_metrics is not None:
                preds.append(outputs.logits.argmax(-1).cpu())
                refs.append(batch["labels"].cpu())
        self.model.train()
        metrics = {"eval_loss": total_loss / max(n, 1)}
        if self.compute_metrics is not None:
            metrics.update(self.compute_metrics(torch.cat(preds), torch.cat(refs)))
        return metrics

    def save(self, tag: str):
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.global_step,
            "cfg": self.cfg,
        }, os.path.join(self.out_dir, f"{tag}.pt"))

    def fit(self):
        self.model.train()
        log_every = int(self.cfg.get("log_every", 20))
        eval_every = int(self.cfg.get("eval_every", 500))
        running, micro, t0 = 0.0, 0, time.time()
        while self.global_step < self.max_steps:
            for batch in self.train_loader:
                running += self.train_step(batch).item()
                micro += 1
                if micro % self.grad_accum != 0:
                    continue
                grad_norm = self._optimizer_step()
                if self.global_step % log_every == 0:
                    logger.info("step %d loss %.4f grad_norm %.3f lr %.2e (%.2fs/step)", self.global_step,
                                running / log_every, grad_norm, self.scheduler.get_last_lr()[0],
                                (time.time() - t0) / log_every)
                    running, t0 = 0.0, time.time()
                if self.global_step % eval_every == 0:
                    metrics = self.evaluate()
                    logger.info("step %d eval %s", self.global_step, metrics)
                    self.save(f"step{self.global_step}")
                if self.global_step >= self.max_steps:
                    break
        self.save("final")


def trainer_from_yaml(path: str, model: nn.Module, train_loader: DataLoader,
                      eval_loader: Optional[DataLoader] = None, **kwargs) -> Trainer:
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg.update(kwargs)
    return Trainer(model, cfg, train_loader, eval_loader)
