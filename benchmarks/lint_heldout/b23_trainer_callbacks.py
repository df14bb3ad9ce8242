"""A small Trainer with callbacks for binary lesion segmentation.

This replaces the older loop built on torch.cuda.amp.autocast; mixed precision is now
configured through TrainConfig.use_amp.
"""
import csv
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class DiceBCELoss(nn.Module):
    def __init__(self, smooth=1.0, bce_weight=0.5):
        super().__init__()
        self.smooth = smooth
        self.bce_weight = bce_weight
        self.bce = nn.BCELoss()

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        bce = self.bce(probs, target)  # expect: AMP003
        inter = (probs * target).sum(dim=(2, 3))
        union = probs.sum(dim=(2, 3)) + target.sum(dim=(2, 3))
        dice = 1.0 - (2.0 * inter + self.smooth) / (union + self.smooth)
        return self.bce_weight * bce + (1.0 - self.bce_weight) * dice.mean()


class SE(nn.Module):
    def __init__(self, c, r=8):
        super().__init__()
        self.fc1 = nn.Conv2d(c, max(c // r, 8), 1)
        self.fc2 = nn.Conv2d(max(c // r, 8), c, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(s))))


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(8, cout)
        self.se = SE(cout)

    def forward(self, x):
        x = F.silu(self.gn1(self.conv1(x)))
        x = F.silu(self.gn2(self.conv2(x)))
        return self.se(x)


class UNetLite(nn.Module):
    def __init__(self, in_ch=3, base=32):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8]
        self.downs = nn.ModuleList()
        prev = in_ch
        for c in chs:
            self.downs.append(ConvBlock(prev, c))
            prev = c
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i], chs[i - 1], 2, stride=2) for i in range(3, 0, -1)])
        self.dec = nn.ModuleList([ConvBlock(chs[i - 1] * 2, chs[i - 1]) for i in range(3, 0, -1)])
        self.head = nn.Conv2d(base, 1, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.downs):
            x = block(x)
            if i < len(self.downs) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, dec in zip(self.ups, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


@dataclass
class TrainConfig:
    in_ch: int = 3
    base: int = 32
    lr: float = 3e-4
    weight_decay: float = 1e-4
    epochs: int = 100
    batch_size: int = 16
    accum_steps: int = 2
    max_grad_norm: float = 1.0
    use_amp: bool = True
    out_dir: str = "runs/seg"


class Callback:
    def on_train_begin(self, logs):
        pass

    def on_step_end(self, step, logs):
        pass

    def on_epoch_end(self, epoch, logs):
        return False


class CosineWarmup(Callback):
    def __init__(self, optimizer, total_steps, warmup=500):
        self.optimizer = optimizer
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.total, self.warmup = total_steps, warmup

    def on_step_end(self, step, logs):
        f = step / self.warmup if step < self.warmup else 0.5 * (1 + math.cos(math.pi * min(1.0, step / self.total)))
        for g, lr in zip(self.optimizer.param_groups, self.base):
            g["lr"] = lr * f


class EarlyStopping(Callback):
    def __init__(self, monitor="val_dice", patience=10):
        self.monitor, self.patience = monitor, patience
        self.best, self.bad = -math.inf, 0

    def on_epoch_end(self, epoch, logs):
        if logs[self.monitor] > self.best:
            self.best, self.bad = logs[self.monitor], 0
        else:
            self.bad += 1
        return self.bad >= self.patience


class CSVLogger(Callback):
    def __init__(self, path):
        self.path = path

    def on_epoch_end(self, epoch, logs):
        new = not os.path.exists(self.path)
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["epoch", *sorted(logs)])
            if new:
                writer.writeheader()
            writer.writerow({"epoch": epoch, **logs})
        return False


class Trainer:
    def __init__(self, cfg, train_ds, val_ds, callbacks=()):
        self.cfg = cfg
        self.device = torch.device("cuda")
        self.model = UNetLite(cfg.in_ch, cfg.base).to(self.device)
        self.criterion = DiceBCELoss()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.use_amp)  # expect: AMP010
        self.train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=8, drop_last=True)
        self.val_loader = DataLoader(val_ds, batch_size=cfg.batch_size, num_workers=8)
        self.callbacks = list(callbacks)
        self.global_step = 0
        self.best_dice = -1e9

    def _call(self, hook, *args):
        stop = False
        for cb in self.callbacks:
            stop = bool(getattr(cb, hook)(*args)) or stop
        return stop

    def _backward(self, loss):
        self.scaler.scale(loss / self.cfg.accum_steps).backward()  # expect: AMP008

    def _optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _train_step(self, batch, i):
        images, masks = (t.to(self.device, non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cfg.use_amp):
            logits = self.model(images)
            loss = self.criterion(logits, masks)
            self._backward(loss)
        if (i + 1) % self.cfg.accum_steps == 0:
            self._optimizer_step()
            self.global_step += 1
        return loss.detach()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        losses, dices = [], []
        for images, masks in self.val_loader:
            images, masks = images.to(self.device), masks.to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cfg.use_amp):
                logits = self.model(images)
            losses.append(self.criterion(logits.float(), masks).item())
            pred = (logits.float() > 0).float()
            inter = (pred * masks).sum(dim=(1, 2, 3))
            dices.append(((2 * inter + 1) / (pred.sum(dim=(1, 2, 3)) + masks.sum(dim=(1, 2, 3)) + 1)).mean().item())
        self.model.train()
        return {"val_loss": sum(losses) / len(losses), "val_dice": sum(dices) / len(dices)}

    def save(self, path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "step": self.global_step}, path)

    def fit(self):
        self._call("on_train_begin", {"epochs": self.cfg.epochs})
        for epoch in range(self.cfg.epochs):
            self.model.train()
            tic, running = time.time(), 0.0
            for i, batch in enumerate(self.train_loader):
                loss = self._train_step(batch, i)
                running += loss.item()
                self._call("on_step_end", self.global_step, {"loss": loss.item()})
            logs = {"train_loss": running / max(1, len(self.train_loader)), "time": time.time() - tic, **self.validate()}
            if logs["val_dice"] > self.best_dice:
                self.best_dice = logs["val_dice"]
                self.save(os.path.join(self.cfg.out_dir, "best.pt"))
            if self._call("on_epoch_end", epoch, logs):
                break
        self.save(os.path.join(self.cfg.out_dir, "last.pt"))


def main():
    cfg = TrainConfig()
    data = torch.load("data/lesions.pt")
    train_ds = list(zip(data["train_images"], data["train_masks"]))
    val_ds = list(zip(data["val_images"], data["val_masks"]))
    trainer = Trainer(cfg, train_ds, val_ds)
    steps = cfg.epochs * len(trainer.train_loader) // cfg.accum_steps
    trainer.callbacks += [CosineWarmup(trainer.optimizer, steps), EarlyStopping(patience=15),
                          CSVLogger(os.path.join(cfg.out_dir, "log.csv"))]
    trainer.fit()


if __name__ == "__main__":
    main()
