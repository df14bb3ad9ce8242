"""Quantisation-aware fine-tuning of the wake-word detector (int8 target, fbgemm/qnnpack).

Starts from the fp32 checkpoint, inserts LSQ fake-quantisers on activations and
weights, optionally distils from the (frozen, fp16) full-size teacher, and trains
with fp16 autocast + GradScaler. The model emits one logit per clip.
"""
import argparse
import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from kws.data import KeywordDataset, collate_padded
from kws.models import build_teacher

log = logging.getLogger("qat")


@dataclass
class QATConfig:
    data_root: str = "data/kws"
    out_dir: str = "runs/qat"
    epochs: int = 10
    batch_size: int = 256
    lr: float = 5e-4
    weight_decay: float = 1e-4
    bits: int = 8
    amp: bool = True
    grad_clip: float = 5.0
    kd_weight: float = 0.5
    kd_temperature: float = 2.0
    freeze_bn_epoch: int = 6
    pos_weight: float = 4.0


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        return grad


def grad_scale(x, scale: float):
    return (x - x * scale).detach() + x * scale


class LsqQuantizer(nn.Module):
    """Learned step size quantisation (Esser et al. 2020)."""

    def __init__(self, bits: int = 8, signed: bool = True):
        super().__init__()
        self.qmin = -(2 ** (bits - 1)) if signed else 0
        self.qmax = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
        self.step = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, x):
        if not bool(self.initialized):
            with torch.no_grad():
                init = 2 * x.detach().float().abs().mean() / math.sqrt(self.qmax)
                self.step.copy_(init.clamp(min=1e-6))
                self.initialized.fill_(True)
        g = 1.0 / math.sqrt(x.numel() * self.qmax)
        step = grad_scale(self.step.abs() + 1e-8, g)
        q = torch.clamp(_RoundSTE.apply(x.float() / step), self.qmin, self.qmax)
        return (q * step).to(x.dtype)


class QConv1d(nn.Conv1d):
    def __init__(self, *args, bits: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        self.wq = LsqQuantizer(bits, signed=True)
        self.aq = LsqQuantizer(bits, signed=False)

    def forward(self, x):
        return self._conv_forward(self.aq(x), self.wq(self.weight), self.bias)


class DSConvBlock(nn.Module):
    def __init__(self, c_in, c_out, kernel, stride=1, bits=8):
        super().__init__()
        self.dw = QConv1d(c_in, c_in, kernel, stride=stride, padding=kernel // 2, groups=c_in, bits=bits)
        self.pw = QConv1d(c_in, c_out, 1, bits=bits)
        self.bn = nn.BatchNorm1d(c_out)

    def forward(self, x):
        return F.relu(self.bn(self.pw(self.dw(x))))


class WakeWordNet(nn.Module):
    def __init__(self, n_mels=40, channels=(64, 96, 128, 160), bits=8):
        super().__init__()
        blocks, c = [], n_mels
        for i, ch in enumerate(channels):
            blocks.append(DSConvBlock(c, ch, kernel=9 if i == 0 else 5, stride=2 if i < 2 else 1, bits=bits))
            c = ch
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, 1)

    def forward(self, spec, lengths: Optional[torch.Tensor] = None):
        h = self.blocks(spec)
        pooled = F.adaptive_max_pool1d(h, 1).squeeze(-1)
        return self.head(pooled).squeeze(-1)


def freeze_bn_stats(model: nn.Module):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.eval()
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)


class QATTrainer:
    def __init__(self, cfg: QATConfig, model: WakeWordNet, teacher: Optional[nn.Module], device="cuda"):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.teacher = None
        if teacher is not None:
            self.teacher = teacher.to(device).half().eval()
            self.teacher.requires_grad_(False)
        self.criterion = nn.BCELoss()
        self.aux_criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(cfg.pos_weight, device=device))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.best_far = 1e9

    def train_step(self, batch):
        specs = batch["spec"].to(self.device, non_blocking=True).half()  # expect: AMP001
        labels = batch["label"].to(self.device, dtype=torch.float32)
        t_logits = None
        if self.teacher is not None:
            with torch.no_grad():
                t_logits = self.teacher(specs).float()

        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            logits = self.model(specs)
            probs = torch.sigmoid(logits)
            loss = self.criterion(probs, labels)  # expect: AMP003
            loss = loss + 0.1 * self.aux_criterion(logits, labels)
            if t_logits is not None:
                T = self.cfg.kd_temperature
                soft = torch.sigmoid(t_logits / T)
                loss = loss + self.cfg.kd_weight * F.binary_cross_entropy_with_logits(logits / T, soft) * T * T

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach(), grad_norm

    @torch.no_grad()
    def evaluate(self, loader, threshold: float = 0.5):
        self.model.eval()
        tp = fp = fn = tn = 0
        total_bce, n = 0.0, 0
        for batch in loader:
            specs = batch["spec"].to(self.device, dtype=torch.float16)
            labels = batch["label"].to(self.device, dtype=torch.float32)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                logits = self.model(specs)
            probs = torch.sigmoid(logits.float())
            total_bce += F.binary_cross_entropy(probs, labels, reduction="sum").item()
            n += labels.numel()
            pred = probs > threshold
            tp += int((pred & (labels > 0.5)).sum())
            fp += int((pred & (labels < 0.5)).sum())
            fn += int((~pred & (labels > 0.5)).sum())
            tn += int((~pred & (labels < 0.5)).sum())
        self.model.train()
        return {
            "bce": total_bce / max(n, 1),
            "frr": fn / max(tp + fn, 1),
            "far": fp / max(fp + tn, 1),
        }

    def fit(self, train_loader, val_loader):
        step = 0
        for epoch in range(self.cfg.epochs):
            self.model.train()
            if epoch >= self.cfg.freeze_bn_epoch:
                freeze_bn_stats(self.model)
            for batch in train_loader:
                loss, grad_norm = self.train_step(batch)
                step += 1
                if step % 100 == 0:
                    log.info("epoch %d step %d loss %.4f |g| %.2f scale %.0f", epoch, step, loss.item(),
                             float(grad_norm), self.scaler.get_scale())
            metrics = self.evaluate(val_loader)
            log.info("epoch %d: %s", epoch, metrics)
            if metrics["far"] < self.best_far:
                self.best_far = metrics["far"]
                torch.save({"model": self.model.state_dict(), "cfg": asdict(self.cfg), "epoch": epoch},
                           os.path.join(self.cfg.out_dir, "qat_best.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True, help="fp32 checkpoint to start from")
    p.add_argument("--teacher", default=None)
    p.add_argument("--no-amp", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = QATConfig(amp=not args.no_amp)
    os.makedirs(cfg.out_dir, exist_ok=True)

    model = WakeWordNet(bits=cfg.bits)
    state = torch.load(args.init, map_location="cpu")
    model.load_state_dict(state["model"], strict=False)
    teacher = build_teacher(args.teacher) if args.teacher else None

    train_ds = KeywordDataset(cfg.data_root, split="train", augment=True)
    val_ds = KeywordDataset(cfg.data_root, split="val")
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=8,
                              collate_fn=collate_padded, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.batch_size, collate_fn=collate_padded)
    QATTrainer(cfg, model, teacher).fit(train_loader, val_loader)


if __name__ == "__main__":
    main()
