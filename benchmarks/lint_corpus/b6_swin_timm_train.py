#!/usr/bin/env python3
""" ImageNet training script for Swin / ViT models, trimmed down from timm's train.py.

Keeps the parts we use: mixup/cutmix with soft targets, native AMP (fp16 with a loss
scaler, bf16 without), gradient accumulation, model EMA, channels_last, checkpointing.

    torchrun --nproc_per_node=8 train_swin.py /data/imagenet --model swin_base_patch4_window7_224 \
        --amp --amp-dtype bfloat16 -b 128 --lr 1e-3 --clip-grad 5.0 --model-ema
"""
import argparse
import copy
import logging
import os
import time
from collections import OrderedDict
from contextlib import suppress
from functools import partial

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from torchvision.datasets import ImageFolder

_logger = logging.getLogger("train")

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("data_dir", metavar="DIR")
parser.add_argument("--model", default="swin_tiny_patch4_window7_224", type=str)
parser.add_argument("--pretrained", action="store_true", default=False)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("-b", "--batch-size", type=int, default=128)
parser.add_argument("--grad-accum-steps", type=int, default=1)
parser.add_argument("--epochs", type=int, default=300)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--weight-decay", type=float, default=0.05)
parser.add_argument("--opt-eps", type=float, default=1e-8)
parser.add_argument("--clip-grad", type=float, default=None)
parser.add_argument("--clip-mode", type=str, default="norm")
parser.add_argument("--mixup", type=float, default=0.8)
parser.add_argument("--smoothing", type=float, default=0.1)
parser.add_argument("--drop-path", type=float, default=0.1)
parser.add_argument("--amp", action="store_true", default=False)
parser.add_argument("--amp-dtype", default="float16", type=str)
parser.add_argument("--model-dtype", default=None, type=str, help="train the model in this dtype (float32 if unset)")
parser.add_argument("--channels-last", action="store_true", default=False)
parser.add_argument("--model-ema", action="store_true", default=False)
parser.add_argument("--model-ema-decay", type=float, default=0.9998)
parser.add_argument("--output", default="./output", type=str)
parser.add_argument("--device", default="cuda", type=str)
parser.add_argument("--workers", type=int, default=8)


def dispatch_clip_grad(parameters, value, mode="norm", norm_type=2.0):
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
    else:
        raise ValueError(f"Unknown clip mode ({mode}).")


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)  # expect: AMP005
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


class Mixup:
    def __init__(self, alpha=0.8, smoothing=0.1, num_classes=1000):
        self.alpha, self.smoothing, self.num_classes = alpha, smoothing, num_classes

    def __call__(self, x, target):
        lam = float(np.random.beta(self.alpha, self.alpha))
        off = self.smoothing / self.num_classes
        y = F.one_hot(target, self.num_classes).float() * (1.0 - self.smoothing) + off
        x = x.mul(lam).add_(x.flip(0).mul_(1.0 - lam))
        return x, y * lam + y.flip(0) * (1.0 - lam)


class ModelEma(nn.Module):
    def __init__(self, model, decay=0.9998):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(model_v.to(ema_v.dtype), 1.0 - self.decay)
            else:
                ema_v.copy_(model_v)


class AverageMeter:
    def __init__(self):
        self.val = self.sum = self.count = self.avg = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    maxk = min(max(topk), output.size()[1])
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.reshape(1, -1).expand_as(pred))
    return [correct[: min(k, maxk)].reshape(-1).float().sum(0) * 100.0 / batch_size for k in topk]


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, device, lr_scheduler=None, amp_autocast=suppress, loss_scaler=None, model_ema=None, mixup_fn=None):
    second_order = hasattr(optimizer, "is_second_order") and optimizer.is_second_order
    batch_time_m, losses_m = AverageMeter(), AverageMeter()
    model.train()

    accum_steps = args.grad_accum_steps
    last_batch_idx = len(loader) - 1
    num_updates = epoch * ((len(loader) + accum_steps - 1) // accum_steps)
    end = time.time()
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        input, target = input.to(device, non_blocking=True), target.to(device, non_blocking=True)
        if mixup_fn is not None:
            input, target = mixup_fn(input, target)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)

        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)
            if accum_steps > 1:
                loss /= accum_steps

            if loss_scaler is not None:
                loss_scaler(loss, optimizer, clip_grad=args.clip_grad, clip_mode=args.clip_mode, parameters=model.parameters(), create_graph=second_order, need_update=need_update)  # expect: AMP008
            else:
                loss.backward(create_graph=second_order)  # expect: AMP008
                if need_update:
                    if args.clip_grad is not None:
                        dispatch_clip_grad(model.parameters(), args.clip_grad, mode=args.clip_mode)
                    optimizer.step()

        losses_m.update(loss.item() * accum_steps, input.size(0))
        if not need_update:
            continue

        num_updates += 1
        optimizer.zero_grad()
        if model_ema is not None:
            model_ema.update(model)
        if device.type == "cuda":
            torch.cuda.synchronize()
        batch_time_m.update(time.time() - end)
        end = time.time()
        if batch_idx % 100 == 0 or last_batch:
            lrl = [g["lr"] for g in optimizer.param_groups]
            _logger.info(f"Train: {epoch} [{batch_idx:>4d}/{len(loader)}] Loss: {losses_m.val:#.3g} ({losses_m.avg:#.3g}) LR: {lrl[0]:.3e} Time: {batch_time_m.avg:.3f}s")
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)

    return OrderedDict([("loss", losses_m.avg)])


def validate(model, loader, loss_fn, args, device, log_suffix=""):
    losses_m, top1_m, top5_m = AverageMeter(), AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for batch_idx, (input, target) in enumerate(loader):
            input, target = input.to(device), target.to(device)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            with torch.cuda.amp.autocast(enabled=args.amp):  # expect: AMP009
                output = model(input)
            if isinstance(output, (tuple, list)):
                output = output[0]
            loss = loss_fn(output, target)  # expect: AMP002
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
            top5_m.update(acc5.item(), output.size(0))
    _logger.info(f"Test{log_suffix}: Loss: {losses_m.avg:>6.3f} Acc@1: {top1_m.avg:>7.3f} Acc@5: {top5_m.avg:>7.3f}")
    return OrderedDict([("loss", losses_m.avg), ("top1", top1_m.avg), ("top5", top5_m.avg)])


def create_optimizer(model, args):
    decay, no_decay = [], []
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim <= 1 or name.endswith(".bias") or name in skip:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": args.weight_decay}]
    return torch.optim.AdamW(groups, lr=args.lr, eps=args.opt_eps)


def save_checkpoint(model, optimizer, loss_scaler, model_ema, epoch, args, path):
    state = {"epoch": epoch, "arch": args.model, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "args": args}
    if loss_scaler is not None:
        state[loss_scaler.state_dict_key] = loss_scaler.state_dict()
    if model_ema is not None:
        state["state_dict_ema"] = model_ema.module.state_dict()
    torch.save(state, path)
    if model_ema is not None:
        # compact release copy of the EMA weights
        torch.save({k: v.half() for k, v in model_ema.module.state_dict().items()}, path.replace(".pth.tar", "-ema-fp16.pth"))


def main():
    logging.basicConfig(level=logging.INFO)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    model = timm.create_model(args.model, pretrained=args.pretrained, num_classes=args.num_classes, drop_path_rate=args.drop_path)
    model_dtype = getattr(torch, args.model_dtype) if args.model_dtype else None
    model.to(device=device, dtype=model_dtype)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    optimizer = create_optimizer(model, args)
    amp_dtype = torch.bfloat16 if args.amp_dtype in ("bfloat16", "bf16") else torch.float16
    amp_autocast = suppress
    loss_scaler = None
    if args.amp:
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if device.type == "cuda" and amp_dtype == torch.float16:
            loss_scaler = NativeScaler()
        _logger.info(f"Using native Torch AMP ({amp_dtype}). Training in mixed precision.")

    model_ema = ModelEma(model, decay=args.model_ema_decay) if args.model_ema else None

    normalize = T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])
    train_set = ImageFolder(os.path.join(args.data_dir, "train"), train_tf)
    eval_set = ImageFolder(os.path.join(args.data_dir, "val"), eval_tf)
    loader_train = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
    loader_eval = torch.utils.data.DataLoader(eval_set, batch_size=args.batch_size, num_workers=args.workers)

    mixup_fn = Mixup(args.mixup, args.smoothing, args.num_classes) if args.mixup > 0 else None
    train_loss_fn = SoftTargetCrossEntropy() if mixup_fn is not None else nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    validate_loss_fn = nn.CrossEntropyLoss().to(device)

    os.makedirs(args.output, exist_ok=True)
    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_metrics = train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args, device, amp_autocast=amp_autocast, loss_scaler=loss_scaler, model_ema=model_ema, mixup_fn=mixup_fn)
        eval_metrics = validate(model, loader_eval, validate_loss_fn, args, device)
        if model_ema is not None:
            ema_metrics = validate(model_ema.module, loader_eval, validate_loss_fn, args, device, log_suffix=" (EMA)")
            eval_metrics = ema_metrics if ema_metrics["top1"] > eval_metrics["top1"] else eval_metrics
        _logger.info(f"epoch {epoch}: train {train_metrics['loss']:.4f} top1 {eval_metrics['top1']:.2f}")
        if eval_metrics["top1"] > best_top1:
            best_top1 = eval_metrics["top1"]
            save_checkpoint(model, optimizer, loss_scaler, model_ema, epoch, args, os.path.join(args.output, "model_best.pth.tar"))


if __name__ == "__main__":
    main()
