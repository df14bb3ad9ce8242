#!/usr/bin/env python3
"""Image classification training with native mixed precision.

Example:
    python train_imagenet_amp.py --data /datasets/imagenet --arch resnet50 \
        --batch-size 256 --lr 0.1 --clip-grad 5.0
"""
import argparse
import copy
import os
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)


def make_grad_scaler(init_scale=2.0 ** 16):
    # older releases only ship the cuda-specific scaler
    try:
        return torch.amp.GradScaler("cuda", init_scale=init_scale)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(init_scale=init_scale)


def parse_args():
    p = argparse.ArgumentParser(description="classification trainer")
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--head-lr-mult", type=float, default=10.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--output", default="./output")
    p.add_argument("--resume", default="")
    p.add_argument("--export", action="store_true", help="write a half precision TorchScript file at the end")
    return p.parse_args()


def build_loaders(args):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader


def build_optimizers(model, args):
    # the freshly initialised classifier gets its own optimizer and a larger lr
    head_params = list(model.fc.parameters())
    head_ids = {id(p) for p in head_params}
    backbone_params = [p for p in model.parameters() if id(p) not in head_ids]
    optimizer = torch.optim.SGD(backbone_params, lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    head_optimizer = torch.optim.SGD(head_params, lr=args.lr * args.head_lr_mult,
                                     momentum=args.momentum)
    return optimizer, head_optimizer


def train_one_epoch(epoch, model, loader, optimizer, head_optimizer, scaler, args):
    model.train()
    running, seen = 0.0, 0
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        with amp_autocast():
            output = model(images)
        loss = F.cross_entropy(output, target, label_smoothing=args.label_smoothing)  # expect: AMP002

        optimizer.zero_grad(set_to_none=True)
        head_optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad is not None:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        head_optimizer.step()  # expect: AMP006
        scaler.update()

        running += loss.item() * images.size(0)
        seen += images.size(0)
        if i % args.print_freq == 0:
            elapsed = time.time() - end
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {running / seen:.4f} "
                  f"scale {scaler.get_scale():.0f} {elapsed:.1f}s")
    return running / max(seen, 1)


@torch.no_grad()
def validate(model, loader, args):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with amp_autocast():
            output = model(images)
            loss = F.cross_entropy(output, target)
        loss_sum += loss.item() * images.size(0)
        correct += (output.argmax(dim=1) == target).sum().item()
        total += images.size(0)
    return loss_sum / total, 100.0 * correct / total


def save_checkpoint(path, epoch, model, optimizer, head_optimizer, scaler, best_acc):
    torch.save({
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "head_optimizer": head_optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "best_acc": best_acc,
    }, path)


def export_half_torchscript(model, path):
    frozen = copy.deepcopy(model).eval()
    with torch.inference_mode():
        frozen = frozen.half()
        example = torch.randn(1, 3, 224, 224, device="cuda").half()
        traced = torch.jit.trace(frozen, example)
    traced.save(path)


def main():
    args = parse_args()
    os.makedirs(args.output, exist_ok=True)
    torch.backends.cudnn.benchmark = True

    model = torchvision.models.__dict__[args.arch](weights=None)
    model = model.cuda()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)

    optimizer, head_optimizer = build_optimizers(model, args)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = make_grad_scaler()
    train_loader, val_loader = build_loaders(args)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        head_optimizer.load_state_dict(ckpt["head_optimizer"])
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt.get("best_acc", 0.0)

    for epoch in range(start_epoch, args.epochs):
        train_loss = train_one_epoch(epoch, model, train_loader, optimizer, head_optimizer, scaler, args)
        val_loss, acc = validate(model, val_loader, args)
        scheduler.step()
        print(f"epoch {epoch}: train {train_loss:.4f} val {val_loss:.4f} acc@1 {acc:.2f}")
        save_checkpoint(os.path.join(args.output, "last.pth"), epoch, model, optimizer,
                        head_optimizer, scaler, best_acc)
        if acc > best_acc:
            best_acc = acc
            save_checkpoint(os.path.join(args.output, "best.pth"), epoch, model, optimizer,
                            head_optimizer, scaler, best_acc)

    if args.export:
        export_half_torchscript(model, os.path.join(args.output, "model_fp16.ts"))


if __name__ == "__main__":
    main()
