"""Minimal DDP image-classification trainer with callbacks, EMA and resumable checkpoints.

    torchrun --nproc-per-node 8 ddp_trainer.py --data /datasets/imagenet --model resnet50 --amp
"""
import argparse
import copy
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cls_data import build_train_loader


@dataclass
class TrainConfig:
    epochs: int = 90
    accum_steps: int = 1
    clip_grad: float = 5.0
    label_smoothing: float = 0.1
    ema_decay: float = 0.9998
    amp: bool = False
    channels_last: bool = True
    output_dir: str = "runs/cls"


class Callback:
    def on_train_start(self, trainer):
        pass

    def on_step_end(self, trainer, step, logs):
        pass

    def on_epoch_end(self, trainer, epoch, logs):
        pass


class ThroughputLogger(Callback):
    def __init__(self, every=100):
        self.every = every
        self._t0 = time.perf_counter()

    def on_step_end(self, trainer, step, logs):
        if step % self.every == 0 and trainer.is_main:
            dt = time.perf_counter() - self._t0
            print(f"step {step} loss {logs['loss']:.4f} grad_norm {logs['grad_norm']:.3f} ({self.every / dt:.1f} it/s)")
            self._t0 = time.perf_counter()


class EpochCheckpoint(Callback):
    def on_epoch_end(self, trainer, epoch, logs):
        if trainer.is_main:
            trainer.save_checkpoint(os.path.join(trainer.cfg.output_dir, "last.pth"), epoch)


class ModelEma:
    def __init__(self, model, decay):
        self.decay = decay
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.dtype.is_floating_point:
                ema_v.lerp_(model_v.detach(), 1.0 - self.decay)
            else:
                ema_v.copy_(model_v)


class Trainer:
    def __init__(self, model, optimizer, scheduler, train_loader, cfg, callbacks=()):
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_main = self.rank == 0
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_without_ddp = model
        self.model = DDP(model, device_ids=[self.device.index]) if dist.is_initialized() else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.callbacks = list(callbacks)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.scaler = torch.cuda.amp.GradScaler() if cfg.amp else None  # expect: AMP009
        self.ema = ModelEma(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
        self.global_step = 0
        self.start_epoch = 0

    def train_one_epoch(self, epoch):
        self.model.train()
        accum = self.cfg.accum_steps
        self.optimizer.zero_grad(set_to_none=True)
        for i, (images, targets) in enumerate(self.train_loader):
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            if self.cfg.amp:
                images = images.half()  # expect: AMP001
            if self.cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)

            boundary = (i + 1) % accum == 0
            sync_ctx = nullcontext if boundary or not dist.is_initialized() else self.model.no_sync
            with sync_ctx():
                with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                    outputs = self.model(images)
                loss = self.criterion(outputs, targets)  # expect: AMP002
                loss = loss / accum
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            if not boundary:
                continue

            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
                grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
            self.optimizer.step()  # expect: AMP006
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.model_without_ddp)

            self.global_step += 1
            logs = {"loss": loss.item() * accum, "grad_norm": grad_norm.item(), "lr": self.scheduler.get_last_lr()[0]}
            for cb in self.callbacks:
                cb.on_step_end(self, self.global_step, logs)

    def fit(self):
        for cb in self.callbacks:
            cb.on_train_start(self)
        for epoch in range(self.start_epoch, self.cfg.epochs):
            if hasattr(self.train_loader.sampler, "set_epoch"):
                self.train_loader.sampler.set_epoch(epoch)
            self.train_one_epoch(epoch)
            for cb in self.callbacks:
                cb.on_epoch_end(self, epoch, {"step": self.global_step})

    def save_checkpoint(self, path, epoch):
        state = {
            "model": self.model_without_ddp.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": epoch,
            "global_step": self.global_step,
        }
        if self.ema is not None:
            state["ema"] = {k: v.half() if v.is_floating_point() else v for k, v in self.ema.module.state_dict().items()}
        torch.save(state, path)

    def load_checkpoint(self, path):
        ckpt = torch.load(path, map_location="cpu")
        self.model_without_ddp.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if self.scaler is not None and ckpt.get("scaler") is not None:
            self.scaler.load_state_dict(ckpt["scaler"])
        if self.ema is not None and "ema" in ckpt:
            self.ema.module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in ckpt["ema"].items()})
        self.start_epoch = ckpt["epoch"] + 1
        self.global_step = ckpt["global_step"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default=None)
    args = p.parse_args()

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    cfg = TrainConfig(epochs=args.epochs, accum_steps=args.accum_steps, amp=args.amp)
    model = timm.create_model(args.model, num_classes=1000).cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    loader = build_train_loader(args.data, args.batch_size, distributed=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=cfg.epochs * len(loader) // cfg.accum_steps)
    trainer = Trainer(model, optimizer, scheduler, loader, cfg, callbacks=[ThroughputLogger(), EpochCheckpoint()])
    if args.resume:
        trainer.load_checkpoint(args.resume)
    trainer.fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
