"""Fine-tune a timm ViT on an image folder, with mixup, EMA, gradient accumulation and resume.

    python vit_finetune.py --data /datasets/inat21-mini --model vit_base_patch16_224.augreg_in21k --epochs 30
"""
import argparse
import copy
import json
import math
import os

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup, create_loader, create_dataset
from timm.scheduler import CosineLRScheduler


class SoftTargetCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, logits, target):
        log_probs = F.log_softmax(logits, dim=-1)
        ctx.save_for_backward(log_probs, target)
        return -(target * log_probs).sum(dim=-1)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        log_probs, target = ctx.saved_tensors
        grad_logits = (log_probs.exp() - target) * grad_output.unsqueeze(-1)
        return grad_logits, None


class SoftTargetCrossEntropyLoss(nn.Module):
    def forward(self, logits, target):
        per_sample = SoftTargetCrossEntropyFn.apply(logits, target)
        return per_sample.mean()


class ModelEma:
    def __init__(self, model, decay=0.9999):
        self.decay = decay
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_p, p in zip(self.module.parameters(), model.parameters()):
            ema_p.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)


def train_one_epoch(model, loader, criterion, optimizer, scaler, lr_scheduler, mixup_fn, ema, epoch, args):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    updates_per_epoch = len(loader) // args.accum_steps
    num_updates = epoch * updates_per_epoch
    for step, (images, targets) in enumerate(loader):
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(images)
            loss = criterion(outputs, targets)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise RuntimeError(f"non-finite loss {loss_value} at epoch {epoch} step {step}")

        scaler.scale(loss / args.accum_steps).backward()
        if (step + 1) % args.accum_steps != 0:
            continue
        if args.clip_grad is not None:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        num_updates += 1
        lr_scheduler.step_update(num_updates)
        if ema is not None:
            ema.update(model)
        if num_updates % args.log_every == 0:
            print(f"epoch {epoch} update {num_updates} loss {loss_value:.4f} lr {optimizer.param_groups[0]['lr']:.2e}")


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct, total = 0, 0
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        correct += (logits.argmax(dim=-1) == targets).sum().item()
        total += targets.numel()
    return 100.0 * correct / total


def export_for_serving(model, path):
    serving = copy.deepcopy(model).eval().half()
    torch.save(serving.state_dict(), path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--num-classes", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--output", default="runs/vit_ft")
    p.add_argument("--resume", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    os.makedirs(args.output, exist_ok=True)
    model = timm.create_model(args.model, pretrained=True, num_classes=args.num_classes, drop_path_rate=args.drop_path)
    model.set_grad_checkpointing(args.grad_checkpointing)
    model.cuda()
    data_config = timm.data.resolve_data_config({}, model=model)

    train_ds = create_dataset("", root=args.data, split="train", is_training=True)
    val_ds = create_dataset("", root=args.data, split="validation")
    train_loader = create_loader(train_ds, input_size=data_config["input_size"], batch_size=args.batch_size,
                                 is_training=True, auto_augment="rand-m9-mstd0.5-inc1", num_workers=10)
    val_loader = create_loader(val_ds, input_size=data_config["input_size"], batch_size=2 * args.batch_size,
                               is_training=False, num_workers=10)

    mixup_fn = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                         num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropyLoss() if mixup_fn is not None else nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    updates_per_epoch = len(train_loader) // args.accum_steps
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * updates_per_epoch, warmup_t=updates_per_epoch,
                                     warmup_lr_init=1e-6, t_in_epochs=False)
    ema = ModelEma(model, args.ema_decay) if args.ema_decay > 0 else None

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        if ema is not None and "ema" in ckpt:
            ema.module.load_state_dict(ckpt["ema"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt.get("best_acc", 0.0)

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, lr_scheduler, mixup_fn, ema, epoch, args)
        acc = evaluate(ema.module if ema is not None else model, val_loader)
        best_acc = max(best_acc, acc)
        print(json.dumps({"epoch": epoch, "val_top1": acc, "best_top1": best_acc}))
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                    "ema": ema.module.state_dict() if ema is not None else None, "epoch": epoch, "best_acc": best_acc},
                   os.path.join(args.output, "last.pth"))

    export_for_serving(ema.module if ema is not None else model, os.path.join(args.output, "serving_fp16.pth"))


if __name__ == "__main__":
    main()
