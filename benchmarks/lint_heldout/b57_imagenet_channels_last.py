"""ImageNet classification training, torchvision-reference style.

Options: channels_last memory format, AMP (fp16 autocast + GradScaler), and
``--pure-fp16`` (weights and activations in fp16, no autocast, no scaler), kept for
comparison runs on V100s.  ``--probe`` trains a linear classifier on frozen features.
"""

import argparse
import copy
import datetime
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms.v2 as T
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_param, param, num_averaged):
            return decay * avg_param + (1 - decay) * param

        super().__init__(model, device, ema_avg, use_buffers=True)


def build_loaders(args):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(args.train_crop_size, antialias=True), T.RandomHorizontalFlip(),
                          T.TrivialAugmentWide(), T.PILToTensor(), T.ToDtype(torch.float, scale=True), normalize,
                          T.RandomErasing(args.random_erase)])
    val_tf = T.Compose([T.Resize(args.val_resize_size, antialias=True), T.CenterCrop(args.val_crop_size),
                        T.PILToTensor(), T.ToDtype(torch.float, scale=True), normalize])
    train_set = ImageFolder(os.path.join(args.data_path, "train"), train_tf)
    val_set = ImageFolder(os.path.join(args.data_path, "val"), val_tf)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader


def train_one_epoch(model, criterion, optimizer, loader, device, epoch, args, scaler=None, model_ema=None):
    model.train()
    start = time.time()
    for i, (image, target) in enumerate(loader):
        image = image.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        if args.pure_fp16:
            image = image.half()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp and not args.pure_fp16):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip_grad_norm is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()

        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
        if i % args.print_freq == 0:
            rate = (i + 1) * args.batch_size / (time.time() - start)
            print(f"Epoch [{epoch}] [{i}/{len(loader)}] loss {loss.item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} {rate:.0f} img/s")


def evaluate(model, criterion, loader, device, args, prefix=""):
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    with torch.inference_mode():
        for image, target in loader:
            image = image.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            if args.pure_fp16:
                image = image.half()
            output = model(image)
            loss_sum += criterion(output.float(), target).item() * image.size(0)
            correct += (output.argmax(1) == target).sum().item()
            total += image.size(0)
    print(f"{prefix}Acc@1 {100.0 * correct / total:.3f} loss {loss_sum / total:.4f}")
    return 100.0 * correct / total


def train_linear_probe(args, backbone, loader, device, feature_dim):
    """Linear classifier on frozen, half-precision features."""
    backbone.requires_grad_(False)
    backbone.eval()
    backbone.half()
    head = nn.Linear(feature_dim, args.num_classes).to(device)
    if args.fp16:
        head = head.half()  # expect: AMP001
    optimizer = torch.optim.SGD(head.parameters(), lr=args.probe_lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
    for epoch in range(args.probe_epochs):
        for images, targets in loader:
            images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.no_grad():
                feats = backbone(images.half()).flatten(1)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = F.cross_entropy(head(feats), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return head


def export_torchscript(model, path, crop_size=224):
    m = copy.deepcopy(model).eval().half().to(memory_format=torch.channels_last)
    example = torch.randn(1, 3, crop_size, crop_size, dtype=torch.float16).to(memory_format=torch.channels_last)
    torch.jit.trace(m, example).save(path)


def benchmark(model, device, batch_size=256, iters=50):
    m = copy.deepcopy(model).to(device).eval()
    x = torch.randn(batch_size, 3, 224, 224, device=device, dtype=torch.float16).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        m.half()
        for _ in range(10):
            m(x)
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(iters):
            m(x)
        torch.cuda.synchronize()
    return batch_size * iters / (time.time() - t0)


def main(args):
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    train_loader, val_loader = build_loaders(args)

    model = torchvision.models.get_model(args.model, weights=args.weights, num_classes=args.num_classes)
    model.to(device)
    model = model.to(memory_format=torch.channels_last)
    if args.pure_fp16:
        model = model.half()

    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    param_groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.opt == "sgd":
        optimizer = torch.optim.SGD(param_groups, lr=args.lr, momentum=args.momentum, nesterov=True)
    elif args.opt == "adamw":
        optimizer = torch.optim.AdamW(param_groups, lr=args.lr)  # expect: AMP011
    else:
        raise RuntimeError(f"Invalid optimizer {args.opt}")
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    scaler = torch.cuda.amp.GradScaler() if args.amp and not args.pure_fp16 else None  # expect: AMP009

    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.lr_warmup_epochs)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [args.lr_warmup_epochs])
    model_ema = ExponentialMovingAverage(model, decay=1.0 - args.model_ema_decay, device=device) if args.model_ema else None

    best = 0.0
    start_time = time.time()
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, optimizer, train_loader, device, epoch, args, scaler, model_ema)
        lr_scheduler.step()
        acc = evaluate(model, criterion, val_loader, device, args)
        if model_ema:
            evaluate(copy.deepcopy(model_ema.module).half(), criterion, val_loader, device, args, prefix="EMA ")
        checkpoint = {
            "model": copy.deepcopy(model).half().state_dict(),
            "model_ema": copy.deepcopy(model_ema.module).half() if model_ema else None,
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "epoch": epoch,
            "args": args,
        }
        torch.save(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
        if acc > best:
            best = acc
            torch.save(checkpoint, os.path.join(args.output_dir, "model_best.pth"))
    print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}, best Acc@1 {best:.3f}")

    if args.probe:
        train_linear_probe(args, copy.deepcopy(model.float()), train_loader, device, args.feature_dim)
    print(f"throughput (fp16, channels_last): {benchmark(model, device):.0f} img/s")
    export_torchscript(model, os.path.join(args.output_dir, "model_fp16.pt"))


def get_args_parser():
    p = argparse.ArgumentParser(description="ImageNet classification training")
    p.add_argument("--data-path", default="/datasets01/imagenet_full_size/061417/")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--weights", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("-b", "--batch-size", default=128, type=int)
    p.add_argument("--epochs", default=90, type=int)
    p.add_argument("-j", "--workers", default=16, type=int)
    p.add_argument("--opt", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--lr", default=0.5, type=float)
    p.add_argument("--momentum", default=0.9, type=float)
    p.add_argument("--wd", "--weight-decay", default=2e-5, type=float, dest="weight_decay")
    p.add_argument("--label-smoothing", default=0.1, type=float)
    p.add_argument("--lr-warmup-epochs", default=5, type=int)
    p.add_argument("--clip-grad-norm", default=None, type=float)
    p.add_argument("--random-erase", default=0.1, type=float)
    p.add_argument("--train-crop-size", default=176, type=int)
    p.add_argument("--val-resize-size", default=232, type=int)
    p.add_argument("--val-crop-size", default=224, type=int)
    p.add_argument("--num-classes", default=1000, type=int)
    p.add_argument("--model-ema", action="store_true")
    p.add_argument("--model-ema-steps", type=int, default=32)
    p.add_argument("--model-ema-decay", type=float, default=0.99998)
    p.add_argument("--amp", action="store_true", help="fp16 autocast + GradScaler")
    p.add_argument("--pure-fp16", action="store_true", help="cast the model and inputs to fp16, no autocast")
    p.add_argument("--print-freq", default=100, type=int)
    p.add_argument("--output-dir", default=".")
    p.add_argument("--probe", action="store_true")
    p.add_argument("--fp16", action="store_true", help="mixed precision for the linear probe")
    p.add_argument("--probe-lr", default=0.1, type=float)
    p.add_argument("--probe-epochs", default=10, type=int)
    p.add_argument("--feature-dim", default=2048, type=int)
    return p


if __name__ == "__main__":
    main(get_args_parser().parse_args())
