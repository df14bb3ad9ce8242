"""Small multi-GPU trainer for image classification: callbacks, gradient
accumulation, model EMA, mixed precision and an LR range test.

    torchrun --nproc_per_node 8 b30_ddp_trainer.py --data /data/imagenet --accum-steps 2
"""
import argparse
import copy
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


@dataclass
class TrainerConfig:
    epochs: int = 90
    accum_steps: int = 1
    clip_grad: Optional[float] = None
    fp16: bool = False
    amp: bool = True
    amp_dtype: str = "float16"
    channels_last: bool = True
    ema_decay: float = 0.9998
    label_smoothing: float = 0.1
    log_every: int = 50
    out_dir: str = "runs/exp"


class Callback:
    def on_fit_start(self, trainer): ...
    def on_optimizer_step(self, trainer): ...
    def on_train_batch_end(self, trainer, outputs): ...
    def on_validation_end(self, trainer, metrics): ...
    def on_fit_end(self, trainer): ...


class ModelEMA:
    def __init__(self, model, decay=0.9998, warmup=2000):
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay, self.warmup, self.updates = decay, warmup, 0

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.warmup))
        msd = model.state_dict()
        for k, v in self.module.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach().to(v.dtype), alpha=1 - d)


class EMACallback(Callback):
    def __init__(self, decay):
        self.decay = decay
        self.ema = None

    def on_fit_start(self, trainer):
        self.ema = ModelEMA(trainer.unwrapped_model, self.decay)

    def on_optimizer_step(self, trainer):
        self.ema.update(trainer.unwrapped_model)

    def on_validation_end(self, trainer, metrics):
        metrics["ema_acc"] = trainer.validate(trainer.val_loader, model=self.ema.module)["acc"]


class CheckpointCallback(Callback):
    def __init__(self, out_dir, monitor="acc"):
        self.out_dir, self.monitor, self.best = out_dir, monitor, -1e9

    def on_validation_end(self, trainer, metrics):
        if trainer.rank != 0:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        state = {"model": trainer.unwrapped_model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                 "scaler": trainer.scaler.state_dict(), "epoch": trainer.epoch}
        torch.save(state, os.path.join(self.out_dir, "last.pth"))
        if metrics[self.monitor] > self.best:
            self.best = metrics[self.monitor]
            ema = next((cb.ema for cb in trainer.callbacks if isinstance(cb, EMACallback)), None)
            weights = ema.module if ema is not None else trainer.unwrapped_model
            torch.save(copy.deepcopy(weights).half().state_dict(), os.path.join(self.out_dir, "best_fp16.pth"))


class ProgressLogger(Callback):
    def __init__(self, every):
        self.every, self.t0, self.losses = every, time.time(), []

    def on_train_batch_end(self, trainer, outputs):
        self.losses.append(outputs["loss"])
        if trainer.rank == 0 and outputs["stepped"] and trainer.global_step % self.every == 0:
            loss = torch.stack(self.losses).float().mean().item()
            lr = trainer.optimizer.param_groups[0]["lr"]
            print(f"ep {trainer.epoch} step {trainer.global_step} loss {loss:.4f} lr {lr:.3e} "
                  f"scale {trainer.scaler.get_scale():.0f} {time.time() - self.t0:.0f}s")
            self.losses.clear()


class Trainer:
    def __init__(self, model, optimizer, cfg: TrainerConfig, callbacks: Optional[List[Callback]] = None,
                 scheduler=None):
        self.cfg = cfg
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device("cuda", self.local_rank)
        self.model = model.to(self.device)
        if cfg.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.scaler = torch.cuda.amp.GradScaler(enabled=cfg.fp16)  # expect: AMP009
        if cfg.fp16:
            self.model = self.model.half()  # expect: AMP001
        self.unwrapped_model = self.model
        if self.distributed:
            self.model = DDP(self.model, device_ids=[self.local_rank])
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.use_amp = cfg.amp
        self.amp_dtype = torch.bfloat16 if cfg.amp_dtype == "bfloat16" else torch.float16
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.callbacks = callbacks or []
        self.global_step = 0
        self.micro_step = 0
        self.epoch = 0
        self.val_loader = None

    def _call(self, hook, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _autocast(self):
        return torch.autocast("cuda", dtype=self.amp_dtype, enabled=self.use_amp)

    def _should_step(self):
        return (self.micro_step + 1) % self.cfg.accum_steps == 0

    def train_step(self, batch) -> Dict[str, torch.Tensor]:
        images = batch[0].to(self.device, non_blocking=True)
        targets = batch[1].to(self.device, non_blocking=True)
        if self.cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.use_amp:
            images = images.half()  # expect: AMP001
        ctx = self.model.no_sync if (self.distributed and not self._should_step()) else nullcontext
        with ctx():
            with self._autocast():
                logits = self.model(images)
                loss = self.criterion(logits, targets)
            self.scaler.scale(loss / self.cfg.accum_steps).backward()
        stepped = self._should_step()
        if stepped:
            if self.cfg.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(self.unwrapped_model.parameters(), self.cfg.clip_grad)  # expect: AMP005
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
            self.global_step += 1
        self.micro_step += 1
        return {"loss": loss.detach(), "stepped": stepped}

    def fit(self, train_loader, val_loader=None):
        self.val_loader = val_loader
        self._call("on_fit_start")
        for epoch in range(self.epoch, self.cfg.epochs):
            self.epoch = epoch
            if isinstance(train_loader.sampler, DistributedSampler):
                train_loader.sampler.set_epoch(epoch)
            self.model.train()
            for batch in train_loader:
                out = self.train_step(batch)
                if out["stepped"]:
                    self._call("on_optimizer_step")
                self._call("on_train_batch_end", out)
            if val_loader is not None:
                metrics = self.validate(val_loader)
                self._call("on_validation_end", metrics)
        self._call("on_fit_end")

    @torch.no_grad()
    def validate(self, loader, model=None):
        model = model if model is not None else self.unwrapped_model
        was_training = model.training
        model.eval()
        stats = torch.zeros(3, device=self.device)
        for images, targets in loader:
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with self._autocast():
                logits = model(images)
            stats[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
            stats[1] += (logits.argmax(1) == targets).sum()
            stats[2] += targets.numel()
        if self.distributed:
            dist.all_reduce(stats)
        model.train(was_training)
        return {"val_loss": (stats[0] / stats[2]).item(), "acc": (stats[1] / stats[2]).item()}

    def lr_range_test(self, loader, start_lr=1e-7, end_lr=10.0, num_iters=100, beta=0.98):
        state = copy.deepcopy(self.unwrapped_model.state_dict())
        opt_state = copy.deepcopy(self.optimizer.state_dict())
        mult = (end_lr / start_lr) ** (1 / num_iters)
        lr, avg_loss, best_loss, history = start_lr, 0.0, float("inf"), []
        self.model.train()
        for i, (images, targets) in enumerate(loader):
            if i >= num_iters:
                break
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.criterion(self.model(images), targets)
                self.scaler.scale(loss).backward()  # expect: AMP008
            self.scaler.step(self.optimizer)
            self.scaler.update()
            avg_loss = beta * avg_loss + (1 - beta) * loss.item()
            smoothed = avg_loss / (1 - beta ** (i + 1))
            history.append((lr, smoothed))
            if smoothed > 4 * best_loss:
                break
            best_loss = min(best_loss, smoothed)
            lr *= mult
        self.unwrapped_model.load_state_dict(state)
        self.optimizer.load_state_dict(opt_state)
        return history

    def overfit_single_batch(self, batch, steps=200):
        images = batch[0].to(self.device, non_blocking=True)
        targets = batch[1].to(self.device, non_blocking=True)
        self.model.train()
        losses = []
        for _ in range(steps):
            with self._autocast():
                loss = self.criterion(self.model(images), targets)
            loss = self.scaler.scale(loss)
            loss.backward()
            self.optimizer.step()  # expect: AMP006
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item() / self.scaler.get_scale())
        return losses


def build_loaders(root, batch_size, workers, distributed):
    T = torchvision.transforms
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(os.path.join(root, "train"), T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    val_set = torchvision.datasets.ImageFolder(os.path.join(root, "val"), T.Compose(
        [T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set) if distributed else None
    val_sampler = DistributedSampler(val_set, shuffle=False) if distributed else None
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=train_sampler is None,
                              sampler=train_sampler, num_workers=workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=batch_size, sampler=val_sampler, num_workers=workers)
    return train_loader, val_loader


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--amp-dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--find-lr", action="store_true")
    args = parser.parse_args()

    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    cfg = TrainerConfig(epochs=args.epochs, accum_steps=args.accum_steps, clip_grad=args.clip_grad,
                        fp16=args.fp16, amp_dtype=args.amp_dtype)
    train_loader, val_loader = build_loaders(args.data, args.batch_size, args.workers, dist.is_initialized())
    model = getattr(torchvision.models, args.arch)(num_classes=1000)
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-5}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, momentum=0.9, nesterov=True)
    steps = args.epochs * len(train_loader) // args.accum_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps, pct_start=0.05)
    trainer = Trainer(model, optimizer, cfg, scheduler=scheduler,
                      callbacks=[EMACallback(cfg.ema_decay), CheckpointCallback(cfg.out_dir),
                                 ProgressLogger(cfg.log_every)])
    if args.find_lr:
        for lr, loss in trainer.lr_range_test(train_loader):
            print(f"{lr:.2e}\t{loss:.4f}")
        return
    trainer.fit(train_loader, val_loader)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
