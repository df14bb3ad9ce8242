"""ImageNet-style classification training with a selectable precision.

    torchrun --nproc_per_node=8 train_cls.py --data /datasets/imagenet \
        --arch resnet50 --precision bf16 --epochs 90 --batch-size 256

``--precision`` picks how the forward pass runs:

* ``fp32``  plain float32 everywhere
* ``fp16``  autocast to float16 with dynamic loss scaling
* ``bf16``  autocast to bfloat16 (no loss scaling needed)
"""
import argparse
import copy
import logging
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from vision.data import build_imagenet_datasets
from vision.models import create_model
from vision.utils import AverageMeter, accuracy, init_distributed, is_main_process, save_on_master

logger = logging.getLogger("train_cls")

PRECISION_TO_DTYPE = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def parse_args():
    parser = argparse.ArgumentParser(description="ImageNet classification training")
    parser.add_argument("--data", required=True, help="dataset root")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=256, help="per-GPU batch size")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--resume", default="")
    parser.add_argument("--output-dir", default="./checkpoints")
    parser.add_argument("--probe-epochs", type=int, default=0,
                        help="after training, fit a linear probe on frozen features")
    parser.add_argument("--probe-lr", type=float, default=1.0)
    parser.add_argument("--export-half", action="store_true",
                        help="also write an fp16 copy of the final weights")
    parser.add_argument("--benchmark", action="store_true")
    parser.add_argument("--print-freq", type=int, default=50)
    return parser.parse_args()


def cosine_lr(base_lr, epoch, step, steps_per_epoch, warmup_epochs, total_epochs):
    t = epoch + step / steps_per_epoch
    if t < warmup_epochs:
        return base_lr * t / warmup_epochs
    progress = (t - warmup_epochs) / max(1, total_epochs - warmup_epochs)
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * progress))


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, device, args):
    model.train()
    amp_dtype = PRECISION_TO_DTYPE[args.precision]
    use_amp = args.precision != "fp32"

    batch_time = AverageMeter("time")
    losses = AverageMeter("loss")
    top1 = AverageMeter("acc1")
    steps_per_epoch = len(loader)
    end = time.time()

    for i, (images, target) in enumerate(loader):
        lr = cosine_lr(args.lr, epoch, i, steps_per_epoch, args.warmup_epochs, args.epochs)
        for group in optimizer.param_groups:
            group["lr"] = lr

        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if use_amp:
            images = images.half()  # expect: AMP001
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        with torch.autocast("cuda", dtype=amp_dtype, enabled=use_amp):
            output = model(images)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()

        acc1, = accuracy(output, target, topk=(1,))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1.item(), images.size(0))
        batch_time.update(time.time() - end)
        end = time.time()

        if i % args.print_freq == 0 and is_main_process():
            logger.info(
                "epoch %d [%d/%d] lr %.4f loss %.4f (%.4f) acc1 %.2f scale %.0f %.3fs/it",
                epoch, i, steps_per_epoch, lr, losses.val, losses.avg, top1.avg,
                scaler.get_scale() if scaler.is_enabled() else 1.0, batch_time.avg,
            )
    return {"loss": losses.avg, "acc1": top1.avg}


@torch.no_grad()
def evaluate(model, loader, device, args):
    model.eval()
    # validation is cheap in half precision; numbers match fp32 to ~0.05%
    eval_ctx = torch.autocast("cuda", dtype=torch.float16) if args.precision != "fp32" else nullcontext()
    losses = AverageMeter("val_loss")
    top1 = AverageMeter("val_acc1")
    top5 = AverageMeter("val_acc5")
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with eval_ctx:
            output = model(images)
            loss = F.cross_entropy(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1.item(), images.size(0))
        top5.update(acc5.item(), images.size(0))
    return {"loss": losses.avg, "acc1": top1.avg, "acc5": top5.avg}


def train_linear_probe(backbone, num_classes, train_loader, device, args):
    """Fit a linear classifier on frozen pooled features (quick sanity metric)."""
    backbone.eval()
    backbone.requires_grad_(False)
    head = nn.Linear(backbone.num_features, num_classes).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=args.probe_lr, momentum=0.9, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.probe_epochs)

    for epoch in range(args.probe_epochs):
        head.train()
        running = 0.0
        for step, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.no_grad():
                feats = backbone.forward_features(images).flatten(1)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.precision == "fp16"):  # expect: AMP010
                logits = head(feats)
                loss = F.cross_entropy(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.item()
        scheduler.step()
        logger.info("probe epoch %d loss %.4f", epoch, running / max(1, step + 1))
    return head


@torch.inference_mode()
def measure_throughput(model, batch_size, image_size, device, steps=50):
    model.eval()
    x = torch.randn(batch_size, 3, image_size, image_size, device=device)
    with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
        for _ in range(10):
            model(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            model(x)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return steps * batch_size / elapsed


def export_half_checkpoint(model, path):
    """Write an fp16 copy of the weights for the serving team."""
    model_to_save = model.module if hasattr(model, "module") else model
    half_model = copy.deepcopy(model_to_save).half()
    torch.save({"state_dict": half_model.state_dict(), "dtype": "float16"}, path)
    logger.info("wrote fp16 export to %s", path)


def build_loaders(args, distributed):
    train_set, val_set = build_imagenet_datasets(args.data)
    train_sampler = DistributedSampler(train_set) if distributed else None
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=train_sampler is None,
        sampler=train_sampler, num_workers=args.workers, pin_memory=True, drop_last=True,
    )
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    distributed, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True
    if args.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise SystemExit("bf16 requested but this GPU does not support it")

    train_loader, val_loader, train_sampler = build_loaders(args, distributed)

    model = create_model(args.arch, num_classes=1000).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model_without_ddp = model
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
        model_without_ddp = model.module

    decay, no_decay = [], []
    for name, p in model_without_ddp.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, momentum=args.momentum, nesterov=True,
    )
    # loss scaling only matters for fp16; the scaler is a no-op otherwise
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing).to(device)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        best_acc1 = ckpt.get("best_acc1", 0.0)
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, device, args)
        val_stats = evaluate(model, val_loader, device, args)
        is_best = val_stats["acc1"] > best_acc1
        best_acc1 = max(best_acc1, val_stats["acc1"])
        logger.info("epoch %d train %s val %s", epoch, train_stats, val_stats)
        save_on_master(
            {
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_acc1": best_acc1,
                "args": vars(args),
            },
            os.path.join(args.output_dir, "best.pth" if is_best else "last.pth"),
        )

    if args.probe_epochs > 0:
        train_linear_probe(model_without_ddp, 1000, train_loader, device, args)
    if args.export_half and is_main_process():
        export_half_checkpoint(model_without_ddp, os.path.join(args.output_dir, "model_fp16.pth"))
    if args.benchmark and is_main_process():
        ips = measure_throughput(model_without_ddp, args.batch_size, 224, device)
        logger.info("inference throughput: %.1f img/s", ips)


if __name__ == "__main__":
    main()
