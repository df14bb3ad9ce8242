"""GPT-2 style pretraining on pre-tokenized uint16 shards.

    python pretrain_gpt.py --data-dir data/openwebtext --batch-size 12 --grad-accum 40
"""
import argparse
import math
import os
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn as nn

from model import GPT, GPTConfig  # project-local


@dataclass
class TrainConfig:
    data_dir: str = "data/openwebtext"
    out_dir: str = "out"
    block_size: int = 1024
    batch_size: int = 12
    grad_accum: int = 40
    max_iters: int = 600000
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 2000
    lr_decay_iters: int = 600000
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = 2000
    eval_iters: int = 200
    log_interval: int = 10
    compile: bool = True
    resume: bool = False


class Trainer:
    def __init__(self, cfg: TrainConfig, model: nn.Module):
        self.cfg = cfg
        self.device = "cuda"
        self.model = model.to(self.device).bfloat16()  # expect: AMP001
        self.criterion = nn.CrossEntropyLoss(ignore_index=-1)
        self.optimizer = self.model.configure_optimizers(cfg.weight_decay, cfg.lr, (0.9, cfg.beta2), "cuda")
        self.ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        self.scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        self.iter_num = 0
        self.best_val_loss = 1e9
        if cfg.resume:
            self.load(os.path.join(cfg.out_dir, "ckpt.pt"))
        self.raw_model = self.model
        if cfg.compile:
            self.model = torch.compile(self.model)

    def get_batch(self, split):
        data = np.memmap(os.path.join(self.cfg.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - self.cfg.block_size, (self.cfg.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + self.cfg.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + self.cfg.block_size].astype(np.int64)) for i in ix])
        return (x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True))

    def get_lr(self, it):
        c = self.cfg
        if it < c.warmup_iters:
            return c.lr * (it + 1) / (c.warmup_iters + 1)
        if it > c.lr_decay_iters:
            return c.min_lr
        ratio = (it - c.warmup_iters) / (c.lr_decay_iters - c.warmup_iters)
        return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.lr - c.min_lr)

    @torch.no_grad()
    def estimate_loss(self):
        out = {}
        self.model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(self.cfg.eval_iters)
            for k in range(self.cfg.eval_iters):
                x, y = self.get_batch(split)
                with self.ctx:
                    logits = self.model(x)
                    loss = self.criterion(logits.view(-1, logits.size(-1)), y.view(-1))
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        self.model.train()
        return out

    def train_step(self):
        lr = self.get_lr(self.iter_num)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self.get_batch("train")
        for micro_step in range(self.cfg.grad_accum):
            with self.ctx:
                logits = self.model(x)
            loss = self.criterion(logits.view(-1, logits.size(-1)), y.view(-1))  # expect: AMP002
            loss = loss / self.cfg.grad_accum
            # prefetch the next micro-batch while the GPU is busy
            x, y = self.get_batch("train")
            self.scaler.scale(loss).backward()
        if self.cfg.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.iter_num += 1
        return loss.item() * self.cfg.grad_accum, lr

    def save(self, path):
        torch.save({
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "iter_num": self.iter_num,
            "best_val_loss": self.best_val_loss,
        }, path)

    def load(self, path):
        ckpt = torch.load(path, map_location=self.device)
        state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
        self.model.load_state_dict(state)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.iter_num = ckpt["iter_num"]
        self.best_val_loss = ckpt["best_val_loss"]

    def fit(self):
        os.makedirs(self.cfg.out_dir, exist_ok=True)
        t0 = time.time()
        while self.iter_num <= self.cfg.max_iters:
            if self.iter_num % self.cfg.eval_interval == 0:
                losses = self.estimate_loss()
                print(f"step {self.iter_num}: train {losses['train']:.4f}, val {losses['val']:.4f}")
                if losses["val"] < self.best_val_loss:
                    self.best_val_loss = losses["val"]
                    if self.iter_num > 0:
                        self.save(os.path.join(self.cfg.out_dir, "ckpt.pt"))
            lossf, lr = self.train_step()
            if self.iter_num % self.cfg.log_interval == 0:
                dt = time.time() - t0
                t0 = time.time()
                print(f"iter {self.iter_num}: loss {lossf:.4f}, lr {lr:.2e}, "
                      f"time {dt * 1000 / self.cfg.log_interval:.1f}ms/it")


def parse_args():
    p = argparse.ArgumentParser()
    for f in fields(TrainConfig):
        if f.type is bool:
            p.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=f.type, default=f.default)
    return TrainConfig(**vars(p.parse_args()))


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cfg = parse_args()
    model = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=50304))
    Trainer(cfg, model).fit()
