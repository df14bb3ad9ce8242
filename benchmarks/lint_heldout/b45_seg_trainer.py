"""Lesion segmentation with a callback-driven Trainer (torchrun --nproc_per_node=4 ...)."""
import argparse
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class TrainerConfig:
    epochs: int = 60
    lr: float = 3e-4
    weight_decay: float = 1e-4
    grad_accum: int = 2
    max_grad_norm: float = 1.0
    aux_weight: float = 0.4
    compile: bool = True
    ckpt_dir: str = "checkpoints"


class PackedSegDataset(Dataset):
    def __init__(self, path):
        packed = torch.load(path)
        self.images, self.masks = packed["images"], packed["masks"]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        return {"image": self.images[idx].float() / 255.0, "mask": self.masks[idx, None].float()}


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNetLite(nn.Module):
    def __init__(self, widths=(32, 64, 128, 256)):
        super().__init__()
        self.downs = nn.ModuleList(conv_block(cin, w) for cin, w in zip((3,) + widths[:-1], widths))
        self.ups = nn.ModuleList([conv_block(widths[i] + widths[i - 1], widths[i - 1]) for i in range(len(widths) - 1, 0, -1)])
        self.head = nn.Conv2d(widths[0], 1, 1)
        self.aux_head = nn.Conv2d(widths[-1], 1, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.downs):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        bottleneck = skips.pop()
        for block in self.ups:
            skip = skips.pop()
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skip], dim=1))
        out = self.head(x)
        return (out, self.aux_head(bottleneck)) if self.training else out


class DiceBCELoss(nn.Module):
    def __init__(self, smooth=1.0):
        super().__init__()
        self.bce = nn.BCELoss()
        self.smooth = smooth

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        bce = self.bce(probs, target)  # expect: AMP003
        inter = (probs * target).sum(dim=(2, 3))
        denom = probs.sum(dim=(2, 3)) + target.sum(dim=(2, 3))
        dice = 1.0 - (2.0 * inter + self.smooth) / (denom + self.smooth)
        return bce + dice.mean()


def build_optimizer(model, cfg):
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    decay = [p for p in model.parameters() if p.ndim > 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)


def build_scheduler(optimizer, cfg, steps_per_epoch):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.lr, total_steps=cfg.epochs * steps_per_epoch)


class LoggingCallback:
    def on_train_batch_end(self, trainer, step, loss):
        if step % 50 == 0 and trainer.is_main:
            print(f"step {step} loss {loss.item():.4f} scale {trainer.scaler.get_scale():.0f}")


class CheckpointCallback:
    def __init__(self, export_fp16=True):
        self.best = -1e9
        self.export_fp16 = export_fp16

    def on_validation_end(self, trainer, metrics):
        trainer.save_checkpoint(os.path.join(trainer.cfg.ckpt_dir, "last.pt"))
        if metrics["dice"] > self.best and trainer.is_main:
            self.best = metrics["dice"]
            trainer.save_checkpoint(os.path.join(trainer.cfg.ckpt_dir, "best.pt"))
            if self.export_fp16:
                weights = {k: v.half() for k, v in trainer.raw_model.state_dict().items()}
                torch.save(weights, os.path.join(trainer.cfg.ckpt_dir, "best_fp16.pt"))


class Trainer:
    def __init__(self, cfg, model, train_loader, val_loader, callbacks=()):
        self.cfg, self.distributed = cfg, dist.is_available() and dist.is_initialized()
        self.is_main = not self.distributed or dist.get_rank() == 0
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        model = model.to(self.device, memory_format=torch.channels_last)
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, len(train_loader) // cfg.grad_accum)
        if cfg.compile:
            model = torch.compile(model)
        if self.distributed:
            model = DDP(model, device_ids=[self.device.index])
        self.model = model
        self.criterion = DiceBCELoss()
        self.aux_criterion = nn.BCEWithLogitsLoss()
        self.scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 14)  # expect: AMP009
        self.train_loader, self.val_loader = train_loader, val_loader
        self.callbacks = list(callbacks)
        self.epoch, self.global_step = 0, 0

    @property
    def raw_model(self):
        m = self.model.module if isinstance(self.model, DDP) else self.model
        return getattr(m, "_orig_mod", m)

    def _call(self, hook, *args):
        for cb in self.callbacks:
            if hasattr(cb, hook):
                getattr(cb, hook)(self, *args)

    def _to_device(self, batch):
        images = batch["image"].to(self.device, non_blocking=True, memory_format=torch.channels_last)
        return images, batch["mask"].to(self.device, non_blocking=True)

    def training_step(self, batch):
        images, masks = self._to_device(batch)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, aux_logits = self.model(images)
            loss = self.criterion(logits, masks)
        aux_target = F.interpolate(masks, size=aux_logits.shape[-2:], mode="nearest")
        aux_loss = self.aux_criterion(aux_logits, aux_target)  # expect: AMP002
        return loss + self.cfg.aux_weight * aux_loss

    def backward(self, loss):
        self.scaler.scale(loss / self.cfg.grad_accum).backward()

    def optimizer_step(self):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    def fit(self):
        for epoch in range(self.epoch, self.cfg.epochs):
            self.epoch = epoch
            if self.distributed:
                self.train_loader.sampler.set_epoch(epoch)
            self.model.train()
            for i, batch in enumerate(self.train_loader):
                last_micro = (i + 1) % self.cfg.grad_accum == 0
                sync_ctx = self.model.no_sync if (self.distributed and not last_micro) else nullcontext
                with sync_ctx():
                    loss = self.training_step(batch)
                    self.backward(loss)
                if not last_micro:
                    continue
                self.optimizer_step()
                self.global_step += 1
                self._call("on_train_batch_end", self.global_step, loss.detach())
            self._call("on_validation_end", self.validate())

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        total_loss, inter, denom = 0.0, 0.0, 0.0
        for batch in self.val_loader:
            images, masks = self._to_device(batch)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(images)
            total_loss += self.criterion(logits, masks).item()  # expect: AMP002
            preds = (logits.float().sigmoid() > 0.5).float()
            inter += (preds * masks).sum().item()
            denom += (preds.sum() + masks.sum()).item()
        self.model.train()
        return {"val_loss": total_loss / len(self.val_loader), "dice": 2.0 * inter / max(denom, 1.0)}

    def save_checkpoint(self, path):
        if not self.is_main:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                    "epoch": self.epoch + 1, "global_step": self.global_step}, path)

    def load_checkpoint(self, path):
        ckpt = torch.load(path, map_location=self.device)
        self.raw_model.load_state_dict(ckpt["model"])
        for name in ("optimizer", "scheduler", "scaler"):
            getattr(self, name).load_state_dict(ckpt[name])
        self.epoch, self.global_step = ckpt["epoch"], ckpt["global_step"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    cfg = TrainerConfig(ckpt_dir=os.environ.get("CKPT_DIR", "checkpoints"))
    train_ds, val_ds = (PackedSegDataset(os.path.join(args.data, f"{split}.pt")) for split in ("train", "val"))
    sampler = DistributedSampler(train_ds) if dist.is_initialized() else None
    train_loader = DataLoader(train_ds, batch_size=8, sampler=sampler, shuffle=sampler is None, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=16, num_workers=4)
    trainer = Trainer(cfg, UNetLite(), train_loader, val_loader, [LoggingCallback(), CheckpointCallback()])
    if args.resume:
        trainer.load_checkpoint(args.resume)
    trainer.fit()


if __name__ == "__main__":
    main()
