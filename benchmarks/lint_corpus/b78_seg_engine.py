"""Binary segmentation engine (building footprints), YAML driven.

    python -m segkit.engine configs/inria_unet_r50.yaml [--resume work_dirs/x/latest.pth]

The engine is assembled from small mixins (optimizer plumbing, gradient clipping,
checkpointing) so the same pieces can be reused by the change-detection engine.
"""
import argparse
import logging
import math
import os
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader

from segkit.data import build_dataset
from segkit.metrics import BinaryIoU
from segkit.models import build_encoder, build_segmentor

logger = logging.getLogger("segkit")


class DiceBCELoss(nn.Module):
    """BCE + soft Dice on sigmoid probabilities."""

    def __init__(self, bce_weight: float = 0.5, smooth: float = 1.0):
        super().__init__()
        self.bce_weight = bce_weight
        self.smooth = smooth

    def forward(self, logits, target):
        probs = torch.sigmoid(logits)
        bce = F.binary_cross_entropy(probs, target)  # expect: AMP003
        dims = (0, 2, 3)
        inter = (probs * target).sum(dims)
        union = probs.sum(dims) + target.sum(dims)
        dice = 1.0 - ((2.0 * inter + self.smooth) / (union + self.smooth)).mean()
        return self.bce_weight * bce + (1.0 - self.bce_weight) * dice


def prepare_batch(batch, device):
    images = batch["image"].to(device, non_blocking=True).half()  # expect: AMP001
    masks = batch["mask"].to(device, non_blocking=True).float()
    return images, masks


class OptimMixin:
    """Optimizer / scheduler plumbing."""

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self):
        self.optimizer.step()  # expect: AMP006
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_step += 1

    def current_lr(self):
        return self.optimizer.param_groups[0]["lr"]


class ClipGradMixin:
    clip_grad = None

    def clip_gradients(self, max_norm=None):
        max_norm = max_norm or self.clip_grad
        if not max_norm:
            return None
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


class CheckpointMixin:
    def checkpoint_state(self):
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "global_step": self.global_step,
            "epoch": self.epoch,
        }

    def save_checkpoint(self, path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.checkpoint_state(), path)

    def load_checkpoint(self, path):
        state = torch.load(path, map_location="cpu")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("lr_scheduler") is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.global_step = state["global_step"]
        self.epoch = state["epoch"] + 1


class CheckpointHook:
    def __init__(self, work_dir, interval=1):
        self.work_dir = work_dir
        self.interval = interval
        self.best_iou = -1e9

    def after_epoch(self, engine, metrics):
        if (engine.epoch + 1) % self.interval == 0:
            engine.save_checkpoint(os.path.join(self.work_dir, "latest.pth"))
        if metrics["iou"] > self.best_iou:
            self.best_iou = metrics["iou"]
            engine.save_checkpoint(os.path.join(self.work_dir, "best.pth"))


class LoggerHook:
    def __init__(self, interval=50):
        self.interval = interval
        self.t0 = time.time()

    def after_iter(self, engine, stats):
        if engine.global_step % self.interval == 0 and "loss" in stats:
            dt = (time.time() - self.t0) / self.interval
            self.t0 = time.time()
            logger.info("epoch %d step %d loss %.4f lr %.2e %.3fs/it", engine.epoch, engine.global_step,
                        float(stats["loss"]), engine.current_lr(), dt)

    def after_epoch(self, engine, metrics):
        logger.info("epoch %d val: %s", engine.epoch, {k: round(v, 4) for k, v in metrics.items()})


class SegEngine(OptimMixin, ClipGradMixin, CheckpointMixin):
    def __init__(self, cfg, model, train_loader, val_loader, hooks=(), device="cuda"):
        tcfg = cfg["train"]
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.criterion = DiceBCELoss(**cfg.get("loss", {}))
        self.use_amp = tcfg.get("amp", True)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)
        self.accum_steps = tcfg.get("accum_steps", 1)
        self.clip_grad = tcfg.get("clip_grad")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tcfg["lr"],
                                           weight_decay=tcfg.get("weight_decay", 1e-4))
        total = tcfg["epochs"] * math.ceil(len(train_loader) / self.accum_steps)
        self.lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=tcfg["lr"],
                                                                total_steps=total, pct_start=0.05)
        self.hooks = list(hooks)
        self.global_step = 0
        self.epoch = 0

    def call_hooks(self, name, **kwargs):
        for hook in self.hooks:
            fn = getattr(hook, name, None)
            if fn is not None:
                fn(self, **kwargs)

    def run_iter(self, batch, it):
        images, masks = prepare_batch(batch, self.device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            logits = self.model(images)
            loss = self.criterion(logits, masks)
        self.scaler.scale(loss / self.accum_steps).backward()
        stats = {"loss": loss.detach()}
        if (it + 1) % self.accum_steps == 0:
            grad_norm = self.clip_gradients()  # expect: AMP005
            if grad_norm is not None:
                stats["grad_norm"] = grad_norm
            self.optimizer_step()
            self.zero_grad()
        return stats

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        iou = BinaryIoU()
        total_loss, n = 0.0, 0
        for batch in self.val_loader:
            images, masks = prepare_batch(batch, self.device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
                logits = self.model(images)
            total_loss += self.criterion(logits.float(), masks).item() * images.size(0)
            n += images.size(0)
            iou.update((logits > 0).long(), masks.long())
        self.model.train()
        return {"loss": total_loss / max(n, 1), "iou": iou.compute()}

    def fit(self):
        for epoch in range(self.epoch, self.cfg["train"]["epochs"]):
            self.epoch = epoch
            self.call_hooks("before_epoch")
            self.model.train()
            running = defaultdict(float)
            for it, batch in enumerate(self.train_loader):
                stats = self.run_iter(batch, it)
                for k, v in stats.items():
                    running[k] += float(v)
                self.call_hooks("after_iter", stats=stats)
            metrics = self.validate()
            metrics.update({f"train_{k}": v / max(len(self.train_loader), 1) for k, v in running.items()})
            self.call_hooks("after_epoch", metrics=metrics)



class ChangeDetEngine(SegEngine):
    """Bi-temporal change detection: the segmentor sees both acquisitions."""

    def _unpack(self, batch):
        pre = batch["image_a"].to(self.device, non_blocking=True)
        post = batch["image_b"].to(self.device, non_blocking=True)
        change = batch["mask"].to(self.device, non_blocking=True).float()
        return pre, post, change

    def run_iter(self, batch, it):
        pre, post, change = self._unpack(batch)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            logits = self.model(pre, post)
            loss = self.criterion(logits, change)
            self.scaler.scale(loss / self.accum_steps).backward()  # expect: AMP008
        stats = {"loss": loss.detach()}
        if (it + 1) % self.accum_steps == 0:
            stats["grad_norm"] = self.clip_gradients()  # expect: AMP005
            self.optimizer_step()
            self.zero_grad()
        return stats

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        iou = BinaryIoU()
        total_loss, n = 0.0, 0
        for batch in self.val_loader:
            pre, post, change = self._unpack(batch)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
                logits = self.model(pre, post)
            total_loss += self.criterion(logits.float(), change).item() * pre.size(0)
            n += pre.size(0)
            iou.update((logits > 0).long(), change.long())
        self.model.train()
        return {"loss": total_loss / max(n, 1), "iou": iou.compute()}

def pretrain_encoder_simsiam(encoder, loader, cfg, device="cuda"):
    """SimSiam warm-up of the encoder on unlabeled tiles before segmentation training."""
    wcfg = cfg["warmup"]
    dim, pred_dim = wcfg.get("dim", 2048), wcfg.get("pred_dim", 512)
    projector = nn.Sequential(
        nn.Linear(encoder.out_dim, dim, bias=False),
        nn.BatchNorm1d(dim),
        nn.ReLU(inplace=True),
        nn.Linear(dim, dim),
    ).to(device)
    predictor = nn.Sequential(
        nn.Linear(dim, pred_dim, bias=False),
        nn.BatchNorm1d(pred_dim),
        nn.ReLU(inplace=True),
        nn.Linear(pred_dim, dim),
    ).to(device)
    params = list(encoder.parameters()) + list(projector.parameters()) + list(predictor.parameters())
    optimizer = torch.optim.SGD(params, lr=wcfg["lr"], momentum=0.9, weight_decay=1e-4)
    encoder.train()
    for epoch in range(wcfg["epochs"]):
        for step, batch in enumerate(loader):
            x1 = batch["view1"].to(device, non_blocking=True)
            x2 = batch["view2"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                z1 = projector(encoder(x1))
                z2 = projector(encoder(x2))
                p1 = predictor(z1)
                p2 = predictor(z2)
                loss = -0.5 * (F.cosine_similarity(p1.float(), z2.detach().float(), dim=-1).mean()
                               + F.cosine_similarity(p2.float(), z1.detach().float(), dim=-1).mean())
                z_std = z1.std(dim=0).mean().item()  # expect: AMP004
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 100 == 0:
                # z_std near 0 means the representation collapsed
                logger.info("[simsiam] epoch %d step %d loss %.4f z_std %.4f", epoch, step, loss.item(), z_std)
    return encoder


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--resume", default="")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    work_dir = args.work_dir or os.path.join("work_dirs", os.path.splitext(os.path.basename(args.config))[0])
    os.makedirs(work_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO, filename=os.path.join(work_dir, "train.log"))

    train_set = build_dataset(cfg["data"]["train"])
    val_set = build_dataset(cfg["data"]["val"])
    train_loader = DataLoader(train_set, batch_size=cfg["train"]["batch_size"], shuffle=True,
                              num_workers=cfg["data"].get("workers", 8), pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg["train"]["batch_size"], shuffle=False,
                            num_workers=cfg["data"].get("workers", 8), pin_memory=True)

    encoder = build_encoder(cfg["model"]["encoder"])
    if cfg.get("warmup", {}).get("epochs", 0) > 0 and not args.resume:
        unlabeled = build_dataset(cfg["data"]["unlabeled"])
        warm_loader = DataLoader(unlabeled, batch_size=cfg["warmup"]["batch_size"], shuffle=True,
                                 num_workers=cfg["data"].get("workers", 8), drop_last=True)
        encoder = pretrain_encoder_simsiam(encoder.cuda(), warm_loader, cfg)
    model = build_segmentor(cfg["model"], encoder=encoder)

    hooks = [LoggerHook(cfg["train"].get("log_interval", 50)), CheckpointHook(work_dir)]
    engine_cls = ChangeDetEngine if cfg["model"].get("siamese", False) else SegEngine
    engine = engine_cls(cfg, model, train_loader, val_loader, hooks=hooks)
    if args.resume:
        engine.load_checkpoint(args.resume)
    engine.fit()


if __name__ == "__main__":
    main()
