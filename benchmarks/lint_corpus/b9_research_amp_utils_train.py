"""utils/amp.py and train.py of the `ssl-probe` repo, merged into one file for the benchmark.

Stage 1 trains a ResNet on the labelled split, stage 2 fine-tunes at a higher resolution,
and `--probe` runs a frozen-backbone linear probe.
"""
# ============================================================================ utils/amp.py
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.cuda.amp import GradScaler, autocast

_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# inputs are shipped to the GPU in half precision: halves the H2D traffic of the loader
INPUT_DTYPE = torch.float16


def get_amp_context(precision, device_type="cuda"):
    """Autocast context for `precision` ("fp32" | "fp16" | "bf16")."""
    if precision == "fp32" or device_type == "cpu":
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=_PRECISIONS[precision])


def build_scaler(precision):
    return GradScaler(enabled=(precision == "fp16"))  # expect: AMP009


def backward_and_step(loss, optimizer, scaler=None, clip_grad=None, parameters=None):
    """Backward + optional clip + step; works with and without a (possibly disabled) scaler."""
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward()
        if clip_grad is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(parameters, clip_grad)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if clip_grad is not None:
            nn.utils.clip_grad_norm_(parameters, clip_grad)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def clip_and_step(model, optimizer, scaler, max_norm=None):
    """Clip (if asked) and step through the scaler. Returns the total grad norm or None."""
    grad_norm = None
    if max_norm is not None and max_norm > 0:
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()
    return grad_norm


# ============================================================================ train.py
import argparse
import copy
import math
import os
import time

import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader


class ModelEma:
    def __init__(self, model, decay=0.9998):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m.detach(), alpha=1.0 - self.decay)
            else:
                e.copy_(m)


def prepare_batch(batch, device, channels_last=False):
    images, targets = batch
    images = images.to(device, dtype=INPUT_DTYPE, non_blocking=True)  # expect: AMP001
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, targets.to(device, non_blocking=True)


def cosine_lr(step, total, base_lr, warmup):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * t))


def warmup_epoch(model, loader, optimizer, scaler, cfg, device):
    """One epoch at a low LR with the head only; clip through the helper."""
    amp_ctx = get_amp_context(cfg.precision)
    model.train()
    for batch in loader:
        images, targets = prepare_batch(batch, device, cfg.channels_last)
        with amp_ctx:
            loss = F.cross_entropy(model(images), targets, label_smoothing=cfg.smoothing)
        backward_and_step(loss, optimizer, scaler, cfg.clip_grad, model.parameters())


def train_one_epoch(model, loader, optimizer, scaler, cfg, device, epoch, ema=None, step0=0):
    amp_ctx = get_amp_context(cfg.precision)
    model.train()
    step, t0 = step0, time.time()
    for it, batch in enumerate(loader):
        images, targets = prepare_batch(batch, device, cfg.channels_last)
        with amp_ctx:
            logits = model(images)
            loss = F.cross_entropy(logits, targets, label_smoothing=cfg.smoothing) / cfg.accum_steps
        scaler.scale(loss).backward()
        if (it + 1) % cfg.accum_steps == 0:
            for g in optimizer.param_groups:
                g["lr"] = cosine_lr(step, cfg.total_steps, cfg.lr, cfg.warmup_steps)
            grad_norm = clip_and_step(model, optimizer, scaler, cfg.clip_grad)
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(model)
            step += 1
            if step % cfg.log_every == 0:
                gn = grad_norm.item() if grad_norm is not None else float("nan")
                print(f"[ep {epoch} step {step}] loss {loss.item() * cfg.accum_steps:.4f} gnorm {gn:.3f} "
                      f"scale {scaler.get_scale():.0f} {time.time() - t0:.1f}s")
    return step


def finetune_epoch(model, loader, optimizer, scaler, cfg, device):
    """Stage 2: higher resolution, mixup off, small LR."""
    amp_ctx = get_amp_context(cfg.precision)
    model.train()
    for batch in loader:
        images, targets = prepare_batch(batch, device, cfg.channels_last)
        images = F.interpolate(images, size=cfg.ft_resolution, mode="bilinear", align_corners=False)
        with amp_ctx:
            logits = model(images)
            loss = F.cross_entropy(logits, targets)
            backward_and_step(loss, optimizer, scaler, cfg.clip_grad, model.parameters())  # expect: AMP008


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    amp_ctx = get_amp_context(cfg.precision)
    model.eval()
    correct = total = 0
    for batch in loader:
        images, targets = prepare_batch(batch, device, cfg.channels_last)
        with amp_ctx:
            logits = model(images)
        correct += (logits.argmax(dim=1) == targets).sum().item()
        total += targets.numel()
    model.train()
    return correct / max(total, 1)


def linear_probe(backbone, train_loader, val_loader, num_classes, device, epochs=20):
    backbone = copy.deepcopy(backbone).eval().requires_grad_(False)
    backbone.fc = nn.Identity()
    head = nn.Linear(2048, num_classes).to(device)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)
    for _ in range(epochs):
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad(), autocast(dtype=torch.float16):  # expect: AMP009
                feats = backbone(x)
            loss = F.cross_entropy(head(feats.float()), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    correct = total = 0
    with torch.no_grad():
        for x, y in val_loader:
            x, y = x.to(device), y.to(device)
            correct += (head(backbone(x).float()).argmax(1) == y).sum().item()
            total += y.numel()
    return correct / max(total, 1)


def save_checkpoint(path, model, optimizer, scaler, ema, epoch, step, compact=False):
    state = {k: (v.half() if compact and v.is_floating_point() else v) for k, v in model.state_dict().items()}
    ckpt = {"model": state, "epoch": epoch, "step": step}
    if not compact:
        ckpt.update(optimizer=optimizer.state_dict(), scaler=scaler.state_dict())
        if ema is not None:
            ckpt["ema"] = ema.module.state_dict()
    torch.save(ckpt, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--precision", default="fp16", choices=list(_PRECISIONS))
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--ft-epochs", type=int, default=5)
    p.add_argument("--ft-resolution", type=int, default=288)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=2500)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--probe", action="store_true")
    p.add_argument("--out", default="checkpoints")
    cfg = p.parse_args()

    device = torch.device("cuda")
    tf = torchvision.transforms
    train_set = torchvision.datasets.ImageFolder(os.path.join(cfg.data, "train"), tf.Compose(
        [tf.RandomResizedCrop(224), tf.RandomHorizontalFlip(), tf.ToTensor(), tf.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    val_set = torchvision.datasets.ImageFolder(os.path.join(cfg.data, "val"), tf.Compose(
        [tf.Resize(256), tf.CenterCrop(224), tf.ToTensor(), tf.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    train_loader = DataLoader(train_set, cfg.batch_size, shuffle=True, num_workers=10, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, cfg.batch_size, num_workers=10, pin_memory=True)

    model = torchvision.models.__dict__[cfg.arch](num_classes=len(train_set.classes)).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    scaler = build_scaler(cfg.precision)
    ema = ModelEma(model)
    cfg.total_steps = cfg.epochs * len(train_loader) // cfg.accum_steps

    os.makedirs(cfg.out, exist_ok=True)
    warmup_epoch(model, train_loader, optimizer, scaler, cfg, device)
    step = 0
    for epoch in range(cfg.epochs):
        step = train_one_epoch(model, train_loader, optimizer, scaler, cfg, device, epoch, ema, step)
        acc, ema_acc = evaluate(model, val_loader, cfg, device), evaluate(ema.module, val_loader, cfg, device)
        print(f"epoch {epoch}: top1 {acc:.4f} ema {ema_acc:.4f}")
        save_checkpoint(os.path.join(cfg.out, "last.pt"), model, optimizer, scaler, ema, epoch, step)

    for g in optimizer.param_groups:
        g["lr"] = cfg.lr * 0.01
    for _ in range(cfg.ft_epochs):
        finetune_epoch(model, train_loader, optimizer, scaler, cfg, device)
    save_checkpoint(os.path.join(cfg.out, "final_fp16.pt"), model, optimizer, scaler, None, cfg.epochs, step, compact=True)

    if cfg.probe:
        print("linear probe:", linear_probe(model, train_loader, val_loader, len(train_set.classes), device))


if __name__ == "__main__":
    main()
