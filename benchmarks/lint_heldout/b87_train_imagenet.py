#!/usr/bin/env python3
"""Image classification training with torchvision backbones.

Follows the usual ImageNet recipe: SGD with momentum, linear warmup into a
cosine schedule, label smoothing, optional channels-last and mixed precision.
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.utils.data
import torchvision
import torchvision.transforms as T


def get_args():
    p = argparse.ArgumentParser(description="ImageNet classification training")
    p.add_argument("--data", default="/datasets/imagenet", help="folder with train/ and val/")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--amp", action="store_true", help="use mixed precision")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--print-freq", type=int, default=50)
    p.add_argument("--output-dir", default="./checkpoints")
    p.add_argument("--resume", default="")
    return p.parse_args()


def build_loaders(args):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        pin_memory=True, drop_last=True, persistent_workers=args.workers > 0,
    )
    val_loader = torch.utils.data.DataLoader(
        val_set, batch_size=args.batch_size, shuffle=False, num_workers=args.workers, pin_memory=True,
    )
    return train_loader, val_loader, len(train_set.classes)


class AverageMeter:
    def __init__(self, name):
        self.name = name
        self.reset()

    def reset(self):
        self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


def adjust_learning_rate(optimizer, epoch, it, iters_per_epoch, args):
    progress = epoch + it / iters_per_epoch
    if progress < args.warmup_epochs:
        lr = args.lr * progress / args.warmup_epochs
    else:
        t = (progress - args.warmup_epochs) / max(1, args.epochs - args.warmup_epochs)
        lr = 0.5 * args.lr * (1.0 + math.cos(math.pi * t))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, args):
    model.train()
    losses, top1 = AverageMeter("loss"), AverageMeter("acc@1")
    end = time.time()
    for i, (images, target) in enumerate(loader):
        lr = adjust_learning_rate(optimizer, epoch, i, len(loader), args)
        images = images.cuda(non_blocking=True).half()  # expect: AMP001
        target = target.cuda(non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
        loss = criterion(output, target)  # expect: AMP002

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=args.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()

        acc1, = accuracy(output, target)
        losses.update(loss.item(), images.size(0))
        top1.update(acc1.item(), images.size(0))
        if i % args.print_freq == 0:
            dt = time.time() - end
            print(f"epoch {epoch} [{i}/{len(loader)}] lr {lr:.4f} loss {losses.avg:.4f} "
                  f"acc@1 {top1.avg:.2f} ({dt:.1f}s)")
            end = time.time()
    return losses.avg, top1.avg


@torch.no_grad()
def evaluate(model, loader, criterion, args):
    model.eval()
    losses, top1, top5 = AverageMeter("loss"), AverageMeter("acc@1"), AverageMeter("acc@5")
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1.item(), images.size(0))
        top5.update(acc5.item(), images.size(0))
    print(f" * val loss {losses.avg:.4f} acc@1 {top1.avg:.3f} acc@5 {top5.avg:.3f}")
    return top1.avg


def main():
    args = get_args()
    os.makedirs(args.output_dir, exist_ok=True)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, num_classes = build_loaders(args)
    model = torchvision.models.__dict__[args.arch](num_classes=num_classes).cuda()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)

    # no weight decay on norm layers and biases
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim <= 1 else decay).append(param)
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, momentum=args.momentum, nesterov=True,
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing).cuda()
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc1 = ckpt["epoch"] + 1, ckpt["best_acc1"]

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, args)
        acc1 = evaluate(model, val_loader, criterion, args)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        state = {
            "epoch": epoch,
            "arch": args.arch,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "best_acc1": best_acc1,
        }
        torch.save(state, os.path.join(args.output_dir, "last.pth"))
        if is_best:
            torch.save(state, os.path.join(args.output_dir, "best.pth"))


if __name__ == "__main__":
    main()
