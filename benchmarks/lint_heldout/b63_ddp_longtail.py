"""
DDP training for long-tailed classification (ImageNet-LT / iNaturalist 2018) with
gradient accumulation, model EMA and an optional classifier re-training stage (cRT,
Kang et al. 2020) on frozen features with class-balanced sampling.

Falls back to torch.cuda.amp.GradScaler on torch builds that predate torch.amp.GradScaler.

    torchrun --nproc_per_node=4 train_lt.py --data /data/ImageNet_LT --amp --accum-steps 4
"""
import argparse
import copy
import datetime
import json
import logging
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from lt.data import ClassAwareSampler, build_dataset
from lt.losses import LogitAdjustedLoss
from lt.models import build_backbone
from lt.utils import MetricLogger, cosine_schedule, init_distributed_mode, is_main_process

logger = logging.getLogger(__name__)


def get_args_parser():
    parser = argparse.ArgumentParser("long-tail training", add_help=False)
    parser.add_argument("--data", required=True)
    parser.add_argument("--arch", default="resnext50_32x4d")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU, per micro-batch")
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--ema-decay", type=float, default=0.9998)
    parser.add_argument("--tau", type=float, default=1.0, help="logit adjustment strength")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--crt-epochs", type=int, default=0)
    parser.add_argument("--crt-lr", type=float, default=0.2)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--output-dir", default="out/lt")
    parser.add_argument("--resume", default="")
    return parser


class ModelEMA:
    """Exponential moving average of the weights, kept in fp32 next to the model."""

    def __init__(self, model, decay=0.9998, tau=2000):
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay = decay
        self.tau = tau
        self.updates = 0

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        msd = model.state_dict()
        for k, v in self.module.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)
            else:
                v.copy_(msd[k])


def train_one_epoch(model, criterion, loader, optimizer, scaler, ema, epoch, lr_schedule, args):
    model.train()
    metric_logger = MetricLogger(delimiter="  ")
    accum = args.accum_steps
    steps_per_epoch = len(loader) // accum
    optimizer.zero_grad(set_to_none=True)

    for it, (samples, targets) in enumerate(metric_logger.log_every(loader, args.print_freq, f"Epoch [{epoch}]")):
        global_step = epoch * steps_per_epoch + it // accum
        samples = samples.cuda(non_blocking=True).type("torch.cuda.HalfTensor")  # expect: AMP001
        targets = targets.cuda(non_blocking=True)
        last_micro = (it + 1) % accum == 0

        # only all-reduce on the micro-batch that steps
        sync_ctx = nullcontext() if last_micro else model.no_sync()
        with sync_ctx:
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                outputs = model(samples)
                loss = criterion(outputs, targets)
            loss_value = loss.item()
            scaler.scale(loss / accum).backward()

        if not math.isfinite(loss_value):
            raise RuntimeError(f"loss is {loss_value}, stopping training")

        if last_micro:
            for group in optimizer.param_groups:
                group["lr"] = lr_schedule[min(global_step, len(lr_schedule) - 1)]
            if args.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model.module)

        metric_logger.update(loss=loss_value, lr=optimizer.param_groups[0]["lr"],
                             scale=scaler.get_scale() if args.amp else 1.0)

    metric_logger.synchronize_between_processes()
    logger.info("Averaged stats: %s", metric_logger)
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


@torch.no_grad()
def evaluate(model, loader, shot_groups, args, half=False):
    model.eval()
    correct = torch.zeros(args.num_classes, device="cuda")
    total = torch.zeros(args.num_classes, device="cuda")
    loss_sum = torch.zeros((), device="cuda")
    for samples, targets in loader:
        samples = samples.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        if half:
            samples = samples.half()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            outputs = model(samples)
            loss = F.cross_entropy(outputs, targets, reduction="sum")
        loss_sum += loss.float()
        hit = (outputs.argmax(dim=1) == targets).float()
        correct.index_add_(0, targets, hit)
        total.index_add_(0, targets, torch.ones_like(hit))
    for t in (correct, total, loss_sum):
        dist.all_reduce(t)
    per_class = correct / total.clamp(min=1)
    stats = {"acc1": 100.0 * (correct.sum() / total.sum()).item(), "loss": (loss_sum / total.sum()).item()}
    for name, idx in shot_groups.items():
        stats[f"{name}_acc"] = 100.0 * per_class[idx].mean().item()
    return stats


def retrain_classifier(model_without_ddp, loader, args):
    """cRT: re-initialise the classifier and fit it on frozen features, class-balanced."""
    backbone = model_without_ddp.backbone
    backbone.eval()
    backbone.requires_grad_(False)
    head = model_without_ddp.head
    head.reset_parameters()
    head.train()
    optimizer = torch.optim.SGD(head.parameters(), lr=args.crt_lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.crt_epochs * len(loader))

    for epoch in range(args.crt_epochs):
        loader.sampler.set_epoch(epoch)
        for samples, targets in loader:
            samples = samples.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            with torch.no_grad():
                feats = backbone(samples.type(torch.cuda.HalfTensor))
            feats = feats.type(torch.cuda.HalfTensor)  # expect: AMP001
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                logits = head(feats)
                loss = F.cross_entropy(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
        if is_main_process():
            logger.info("cRT epoch %d loss %.4f", epoch, loss.item())
    return head


def save_on_master(state, path):
    if is_main_process():
        torch.save(state, path)


def save_checkpoint(args, epoch, model_without_ddp, ema, optimizer, scaler, name):
    state = {
        "model": model_without_ddp.state_dict(),
        "ema": copy.deepcopy(ema.module).half(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "args": vars(args),
    }
    save_on_master(state, os.path.join(args.output_dir, name))


def release_weights(ema, path):
    torch.save({k: v.half() for k, v in ema.module.state_dict().items()}, path)


def main(args):
    init_distributed_mode(args)
    device = torch.device("cuda", args.gpu)
    torch.backends.cudnn.benchmark = True
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)

    train_set, val_set, cls_num_list, shot_groups = build_dataset(args)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=2 * args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = build_backbone(args.arch, num_classes=args.num_classes).to(device)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(memory_format=torch.channels_last)
    ema = ModelEMA(model, decay=args.ema_decay)
    model = DDP(model, device_ids=[args.gpu])
    model_without_ddp = model.module

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay,
                                nesterov=True)
    try:
        scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    except (AttributeError, TypeError):  # older clusters still run torch 2.1
        scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = LogitAdjustedLoss(cls_num_list, tau=args.tau).to(device)
    lr_schedule = cosine_schedule(args.lr, 0.0, args.epochs, len(loader) // args.accum_steps, warmup_epochs=5)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        model_without_ddp.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"].float().state_dict())
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    best_acc = 0.0
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, loader, optimizer, scaler, ema, epoch, lr_schedule, args)
        val_stats = evaluate(model, val_loader, shot_groups, args)
        ema_stats = evaluate(ema.module, val_loader, shot_groups, args)
        save_checkpoint(args, epoch, model_without_ddp, ema, optimizer, scaler, "checkpoint.pth")
        if ema_stats["acc1"] > best_acc:
            best_acc = ema_stats["acc1"]
            save_checkpoint(args, epoch, model_without_ddp, ema, optimizer, scaler, "best.pth")
        if is_main_process():
            log = {"epoch": epoch, **{f"train_{k}": v for k, v in train_stats.items()},
                   **{f"val_{k}": v for k, v in val_stats.items()}, **{f"ema_{k}": v for k, v in ema_stats.items()}}
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")

    if args.crt_epochs > 0:
        balanced = DataLoader(train_set, batch_size=args.batch_size,
                              sampler=ClassAwareSampler(train_set, num_replicas=dist.get_world_size()),
                              num_workers=args.workers, pin_memory=True, drop_last=True)
        retrain_classifier(model_without_ddp, balanced, args)
        crt_stats = evaluate(model, val_loader, shot_groups, args)
        logger.info("after cRT: %s", crt_stats)

    if is_main_process():
        release_weights(ema, os.path.join(args.output_dir, "ema_fp16.pth"))
    total = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    logger.info("training time %s, best EMA acc %.2f", total, best_acc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser("long-tail training", parents=[get_args_parser()])
    main(parser.parse_args())
