"""Config-driven trainers for the segmentation / pretraining / distillation stages.

Each stage reads a YAML file like::

    stage: segmentation
    precision: fp16        # fp32 | fp16 | bf16
    optim: {lr: 6.0e-5, weight_decay: 0.01}
    train: {epochs: 160, accum_steps: 2, max_grad_norm: 1.0}

and ``run_stage(path)`` builds the matching trainer.
"""
import logging
import math
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils._pytree import tree_map

from seg.data import build_dataloader
from seg.models import build_segmentor, build_encoder, build_student
from seg.metrics import StreamingIoU

log = logging.getLogger(__name__)


def build_autocast(precision, device_type="cuda"):
    """Autocast context for a precision string from the config."""
    if precision == "fp16":
        return torch.autocast(device_type, dtype=torch.float16)
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


def kd_loss(student_logits, teacher_logits, temperature):
    s = F.log_softmax(student_logits / temperature, dim=1)
    t = F.softmax(teacher_logits / temperature, dim=1)
    return F.kl_div(s, t, reduction="batchmean") * temperature ** 2


class SegmentationTrainer:
    def __init__(self, cfg, model, train_loader, val_loader, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.precision = cfg.get("precision", "fp32")
        self.accum_steps = cfg["train"].get("accum_steps", 1)
        self.max_grad_norm = cfg["train"].get("max_grad_norm", 0.0)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg["optim"]["lr"], weight_decay=cfg["optim"]["weight_decay"]
        )
        total = cfg["train"]["epochs"] * math.ceil(len(train_loader) / self.accum_steps)
        self.scheduler = torch.optim.lr_scheduler.PolynomialLR(self.optimizer, total_iters=total, power=1.0)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")
        self.criterion = nn.CrossEntropyLoss(ignore_index=255)
        self.global_step = 0

    def autocast(self):
        return build_autocast(self.precision)

    def backward(self, loss):
        self.scaler.scale(loss / self.accum_steps).backward()

    def optimizer_step(self):
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1

    def train_epoch(self, epoch):
        self.model.train()
        for i, batch in enumerate(self.train_loader):
            images = batch["image"].to(self.device, non_blocking=True)
            masks = batch["mask"].to(self.device, non_blocking=True)
            with self.autocast():
                logits = self.model(images)
                logits = F.interpolate(logits, size=masks.shape[-2:], mode="bilinear", align_corners=False)
                loss = self.criterion(logits, masks)
            self.backward(loss)
            if (i + 1) % self.accum_steps == 0:
                self.optimizer_step()
            if i % 50 == 0:
                log.info("epoch %d it %d loss %.4f", epoch, i, loss.item())

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        iou = StreamingIoU(num_classes=self.cfg["num_classes"], ignore_index=255)
        for batch in self.val_loader:
            images = batch["image"].to(self.device)
            with self.autocast():
                logits = self.model(images)
            logits = F.interpolate(logits.float(), size=batch["mask"].shape[-2:], mode="bilinear")
            iou.update(logits.argmax(1).cpu(), batch["mask"])
        return iou.compute()

    def state_dict(self):
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.global_step,
        }


class ContrastivePretrainer:
    """MoCo-style pretraining of the encoder; ``amp: true`` turns mixed precision on."""

    def __init__(self, cfg, encoder, momentum_encoder, loader, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.use_amp = cfg.get("amp", False)
        self.encoder = encoder.to(device)
        self.momentum_encoder = momentum_encoder.to(device)
        self.momentum_encoder.requires_grad_(False)
        self.loader = loader
        self.temperature = cfg.get("temperature", 0.2)
        self.momentum = cfg.get("momentum", 0.99)
        self.optimizer = torch.optim.SGD(self.encoder.parameters(), lr=cfg["optim"]["lr"],
                                         momentum=0.9, weight_decay=cfg["optim"]["weight_decay"])
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)  # expect: AMP010

    @torch.no_grad()
    def _momentum_update(self):
        for p_q, p_k in zip(self.encoder.parameters(), self.momentum_encoder.parameters()):
            p_k.mul_(self.momentum).add_(p_q.detach(), alpha=1.0 - self.momentum)

    def contrastive_loss(self, q, k):
        q = F.normalize(q.float(), dim=1)
        k = F.normalize(k.float(), dim=1)
        logits = q @ k.t() / self.temperature
        labels = torch.arange(q.size(0), device=q.device)
        return F.cross_entropy(logits, labels)

    def train_step(self, batch):
        batch = tree_map(
            lambda t: t.to(self.device, non_blocking=True).bfloat16() if t.is_floating_point() else t,  # expect: AMP001
            batch,
        )
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.use_amp):
            q = self.encoder(batch["view1"])
            with torch.no_grad():
                self._momentum_update()
                k = self.momentum_encoder(batch["view2"])
            loss = self.contrastive_loss(q, k)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.encoder.parameters(), 3.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item(), grad_norm.item()

    def train(self, epochs):
        self.encoder.train()
        for epoch in range(epochs):
            for i, batch in enumerate(self.loader):
                loss, gnorm = self.train_step(batch)
                if i % 100 == 0:
                    log.info("pretrain epoch %d it %d loss %.4f |g| %.2f", epoch, i, loss, gnorm)


class DistillTrainer:
    """Distil a segmentation teacher into a small student."""

    def __init__(self, cfg, teacher, student, loader, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.teacher = teacher.to(device).half().eval()
        self.teacher.requires_grad_(False)
        self.student = student.to(device)
        self.loader = loader
        self.temperature = cfg.get("kd_temperature", 2.0)
        self.alpha = cfg.get("kd_alpha", 0.7)
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=cfg["optim"]["lr"])
        self.autocast_ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        self.max_grad_norm = cfg["train"].get("max_grad_norm", 1.0)

    def train_epoch(self, epoch):
        self.student.train()
        for i, batch in enumerate(self.loader):
            images = batch["image"].to(self.device, non_blocking=True)
            masks = batch["mask"].to(self.device, non_blocking=True)
            with self.autocast_ctx:
                with torch.no_grad():
                    t_logits = self.teacher(images)
                s_logits = self.student(images)
                loss = self.alpha * kd_loss(s_logits, t_logits, self.temperature) + (
                    1.0 - self.alpha
                ) * F.cross_entropy(s_logits, masks, ignore_index=255)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.student.parameters(), self.max_grad_norm)
            self.optimizer.step()
            if i % 50 == 0:
                log.info("distill epoch %d it %d loss %.4f", epoch, i, loss.item())


def run_stage(config_path):
    with open(config_path) as f:
        cfg = yaml.safe_load(f)
    stage = cfg["stage"]
    if stage == "segmentation":
        trainer = SegmentationTrainer(cfg, build_segmentor(cfg), build_dataloader(cfg, "train"),
                                      build_dataloader(cfg, "val"))
        for epoch in range(cfg["train"]["epochs"]):
            trainer.train_epoch(epoch)
            miou = trainer.validate()
            log.info("epoch %d mIoU %.3f", epoch, miou)
            torch.save(trainer.state_dict(), f"{cfg['work_dir']}/last.pth")
    elif stage == "pretrain":
        trainer = ContrastivePretrainer(cfg, build_encoder(cfg), build_encoder(cfg),
                                        build_dataloader(cfg, "pretrain"))
        trainer.train(cfg["train"]["epochs"])
    elif stage == "distill":
        teacher = build_segmentor(cfg["teacher"])
        teacher.load_state_dict(torch.load(cfg["teacher"]["checkpoint"], map_location="cpu")["model"])
        trainer = DistillTrainer(cfg, teacher, build_student(cfg), build_dataloader(cfg, "train"))
        for epoch in range(cfg["train"]["epochs"]):
            trainer.train_epoch(epoch)
    else:
        raise ValueError(f"unknown stage {stage!r}")


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    run_stage(sys.argv[1])
