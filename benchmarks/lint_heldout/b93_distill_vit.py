"""Distil a ViT-S/16 student from a frozen ViT-B/16 teacher on ImageNet.

The teacher is loaded once in half precision and only ever runs without
grad. The student trains under autocast and keeps an EMA copy that is used
for evaluation and for the released checkpoint.
"""
import argparse
import copy
import math
import os
import time

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher", default="vit_base_patch16_224")
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--student", default="vit_small_patch16_224")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--ema-decay", type=float, default=0.99996)
    p.add_argument("--amp-dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--output", default="./out")
    return p.parse_args()


class ModelEma:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        self.module.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, ema_v in self.module.state_dict().items():
            model_v = msd[k].detach()
            if ema_v.is_floating_point():
                ema_v.mul_(self.decay).add_(model_v.to(ema_v.dtype), alpha=1.0 - self.decay)
            else:
                ema_v.copy_(model_v)


@torch.no_grad()
def load_teacher(name, ckpt_path, device):
    teacher = timm.create_model(name, num_classes=1000)
    state = torch.load(ckpt_path, map_location="cpu")
    teacher.load_state_dict(state.get("model", state))
    teacher = teacher.to(device).half().eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def distill_loss(student_logits, teacher_logits, targets, tau, alpha):
    base = F.cross_entropy(student_logits, targets, label_smoothing=0.1)
    s = F.log_softmax(student_logits.float() / tau, dim=-1)
    t = F.log_softmax(teacher_logits.float() / tau, dim=-1)
    kd = F.kl_div(s, t, reduction="batchmean", log_target=True) * (tau * tau)
    return (1.0 - alpha) * base + alpha * kd


def cosine_lr(step, total, warmup, base_lr, min_lr=1e-6):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def train_one_epoch(student, teacher, ema, loader, optimizer, scaler, args, epoch, device):
    student.train()
    amp_dtype = torch.float16 if args.amp_dtype == "float16" else torch.bfloat16
    total_steps = args.epochs * len(loader)
    warmup_steps = args.warmup_epochs * len(loader)
    t0 = time.time()
    for it, (images, targets) in enumerate(loader):
        step = epoch * len(loader) + it
        lr = cosine_lr(step, total_steps, warmup_steps, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

        images = images.to(device, non_blocking=True).half()  # expect: AMP001
        targets = targets.to(device, non_blocking=True)

        with torch.no_grad():
            teacher_logits = teacher(images)

        with torch.autocast(device_type="cuda", dtype=amp_dtype):
            student_logits = student(images)
            loss = distill_loss(student_logits, teacher_logits, targets, args.tau, args.alpha)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad is not None:
            nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        ema.update(student)

        if it % 100 == 0:
            dt = (time.time() - t0) / (it + 1)
            print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f} lr {lr:.2e} "
                  f"scale {scaler.get_scale():.0f} {dt * 1e3:.0f} ms/it")


@torch.no_grad()
def evaluate(model, loader, device, half=False):
    model.eval()
    if half:
        model = copy.deepcopy(model).half()
    correct = total = 0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if half:
            logits = model(images.half())
        else:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(images)
        correct += (logits.argmax(-1) == targets).sum().item()
        total += targets.numel()
    return 100.0 * correct / max(total, 1)


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(".bias") or "pos_embed" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def main():
    args = get_args()
    os.makedirs(args.output, exist_ok=True)
    device = torch.device("cuda")
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_loader = DataLoader(train_ds, args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, args.batch_size, num_workers=args.workers, pin_memory=True)

    teacher = load_teacher(args.teacher, args.teacher_ckpt, device)
    print(f"teacher top-1: {evaluate(teacher, val_loader, device):.2f}")

    student = timm.create_model(args.student, num_classes=1000, drop_path_rate=0.1).to(device)
    ema = ModelEma(student, args.ema_decay)
    optimizer = torch.optim.AdamW(param_groups(student, args.weight_decay), lr=args.lr,
                                  betas=(0.9, 0.999), eps=1e-8)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp_dtype == "float16")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(student, teacher, ema, train_loader, optimizer, scaler, args, epoch, device)
        acc = evaluate(student, val_loader, device)
        ema_acc = evaluate(ema.module, val_loader, device, half=True)
        print(f"epoch {epoch}: student {acc:.2f} ema {ema_acc:.2f}")
        torch.save({"model": student.state_dict(), "ema": ema.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch}, os.path.join(args.output, "last.pth"))
        if ema_acc > best_acc:
            best_acc = ema_acc
            release = copy.deepcopy(ema.module).half()
            torch.save(release.state_dict(), os.path.join(args.output, "best_ema_fp16.pth"))


if __name__ == "__main__":
    main()
