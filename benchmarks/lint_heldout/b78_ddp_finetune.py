"""Fine-tune a timm backbone on an ImageFolder dataset with DDP.

    torchrun --nproc_per_node=8 finetune.py --model convnext_tiny --finetune ssl_ckpt.pth \
        --data-path /data/inat21 --nb-classes 10000 --fp16 --accum-iter 2

Loosely based on the DeiT / MAE fine-tuning scripts.
"""
import argparse
import datetime
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.backends.cudnn as cudnn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import timm
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.utils import accuracy

import util.misc as misc
from util.datasets import build_dataset
from util.lr_sched import adjust_learning_rate


def get_args_parser():
    parser = argparse.ArgumentParser("fine-tuning", add_help=False)
    parser.add_argument("--batch-size", default=64, type=int, help="per-GPU batch size")
    parser.add_argument("--epochs", default=50, type=int)
    parser.add_argument("--accum-iter", default=1, type=int)
    parser.add_argument("--model", default="convnext_tiny", type=str)
    parser.add_argument("--input-size", default=224, type=int)
    parser.add_argument("--drop-path", type=float, default=0.1)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--blr", type=float, default=0.1)
    parser.add_argument("--min-lr", type=float, default=1e-6)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--finetune", default="")
    parser.add_argument("--data-path", default="/datasets01/imagenet_full_size/061417/")
    parser.add_argument("--nb-classes", default=1000, type=int)
    parser.add_argument("--output-dir", default="./output_dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--resume", default="")
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--eval", action="store_true")
    parser.add_argument("--num-workers", default=10, type=int)
    parser.add_argument("--print-freq", default=20, type=int)
    parser.add_argument("--fp16", action="store_true", help="mixed precision training")
    parser.add_argument("--probe-epochs", default=0, type=int, help="linear probe sanity check before fine-tuning")
    parser.add_argument("--probe-lr", default=0.1, type=float)
    parser.add_argument("--world-size", default=1, type=int)
    parser.add_argument("--local-rank", default=-1, type=int)
    parser.add_argument("--dist-url", default="env://")
    return parser


def optimizer_step(model, optimizer, scaler, max_norm=None):
    """Apply the accumulated gradients; returns the total gradient norm when clipping."""
    grad_norm = None
    if max_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, scaler, args, mixup_fn=None,
                    log_writer=None):
    model.train(True)
    metric_logger = misc.MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", misc.SmoothedValue(window_size=1, fmt="{value:.6f}"))
    header = f"Epoch: [{epoch}]"
    accum_iter = args.accum_iter
    amp_ctx = torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16)
    optimizer.zero_grad(set_to_none=True)

    for it, (samples, targets) in enumerate(metric_logger.log_every(data_loader, args.print_freq, header)):
        if it % accum_iter == 0:
            adjust_learning_rate(optimizer, it / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True, memory_format=torch.channels_last)
        targets = targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)

        update = (it + 1) % accum_iter == 0
        sync_ctx = model.no_sync() if (args.distributed and not update) else nullcontext()
        with sync_ctx:
            with amp_ctx:
                outputs = model(samples)
            loss = criterion(outputs, targets)  # expect: AMP002
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                print(f"Loss is {loss_value}, stopping training")
                sys.exit(1)
            scaler.scale(loss / accum_iter).backward()

        if update:
            grad_norm = optimizer_step(model, optimizer, scaler, args.clip_grad)
            if grad_norm is not None:
                metric_logger.update(grad_norm=grad_norm.item())

        torch.cuda.synchronize()
        metric_logger.update(loss=loss_value)
        lr = max(group["lr"] for group in optimizer.param_groups)
        metric_logger.update(lr=lr)
        loss_value_reduce = misc.all_reduce_mean(loss_value)
        if log_writer is not None and update:
            epoch_1000x = int((it / len(data_loader) + epoch) * 1000)
            log_writer.add_scalar("loss", loss_value_reduce, epoch_1000x)
            log_writer.add_scalar("lr", lr, epoch_1000x)
            log_writer.add_scalar("loss_scale", scaler.get_scale(), epoch_1000x)

    metric_logger.synchronize_between_processes()
    print("Averaged stats:", metric_logger)
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


@torch.no_grad()
def evaluate(data_loader, model, device, use_amp=True):
    criterion = nn.CrossEntropyLoss()
    metric_logger = misc.MetricLogger(delimiter="  ")
    model.eval()
    for images, target in metric_logger.log_every(data_loader, 50, "Test:"):
        images = images.to(device, non_blocking=True, memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        batch_size = images.shape[0]
        metric_logger.update(loss=loss.item())
        metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
        metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)
    metric_logger.synchronize_between_processes()
    print("* Acc@1 {top1.global_avg:.3f} Acc@5 {top5.global_avg:.3f} loss {losses.global_avg:.3f}".format(
        top1=metric_logger.acc1, top5=metric_logger.acc5, losses=metric_logger.loss))
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


def train_linear_probe(backbone, dataset, num_classes, device, args):
    """Quick linear probe on frozen features, to sanity-check the pre-trained weights."""
    backbone.eval().requires_grad_(False)
    head = nn.Sequential(
        nn.BatchNorm1d(backbone.num_features, affine=False),
        nn.Linear(backbone.num_features, num_classes),
    ).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=args.probe_lr, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, shuffle=True,
                                         num_workers=args.num_workers, drop_last=True)
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.fp16 else nullcontext()  # expect: AMP010
    for epoch in range(args.probe_epochs):
        for images, targets in loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.no_grad(), ctx:
                feats = backbone.forward_head(backbone.forward_features(images), pre_logits=True)
            with ctx:
                logits = head(feats)
                loss = F.cross_entropy(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"[probe] epoch {epoch} loss {loss.item():.4f}")
    backbone.requires_grad_(True)
    return head


def save_checkpoint(args, epoch, model_without_ddp, optimizer, scaler, name=None):
    path = Path(args.output_dir) / (name or f"checkpoint-{epoch}.pth")
    misc.save_on_master({
        "model": model_without_ddp.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "args": vars(args),
    }, path)


def main(args):
    misc.init_distributed_mode(args)
    device = torch.device(args.device)
    torch.manual_seed(args.seed + misc.get_rank())
    cudnn.benchmark = True

    dataset_train = build_dataset(is_train=True, args=args)
    dataset_val = build_dataset(is_train=False, args=args)
    if args.distributed:
        sampler_train = torch.utils.data.DistributedSampler(dataset_train, shuffle=True)
        sampler_val = torch.utils.data.DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val, batch_size=2 * args.batch_size,
                                                  num_workers=args.num_workers, pin_memory=True)

    mixup_fn = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                         num_classes=args.nb_classes)

    model = timm.create_model(args.model, pretrained=False, num_classes=args.nb_classes, drop_path_rate=args.drop_path)
    if args.finetune:
        checkpoint = torch.load(args.finetune, map_location="cpu")
        state = checkpoint.get("model", checkpoint)
        own = model.state_dict()
        for k in list(state):
            if k in own and state[k].shape != own[k].shape:
                print(f"dropping {k} from the pre-trained checkpoint (shape mismatch)")
                del state[k]
        print(model.load_state_dict(state, strict=False))
    model.to(device, memory_format=torch.channels_last)
    if args.probe_epochs > 0 and not args.resume:
        train_linear_probe(model, dataset_train, args.nb_classes, device, args)
    if args.fp16:
        model.half()  # expect: AMP001

    model_without_ddp = model
    if args.distributed:
        model = DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    eff_batch_size = args.batch_size * args.accum_iter * misc.get_world_size()
    if args.lr is None:
        args.lr = args.blr * eff_batch_size / 256
    decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=args.lr, momentum=0.9, nesterov=True)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)  # expect: AMP009

    if mixup_fn is not None:
        criterion = SoftTargetCrossEntropy()
    elif args.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()

    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if "scaler" in checkpoint:
            scaler.load_state_dict(checkpoint["scaler"])
        args.start_epoch = checkpoint["epoch"] + 1

    if args.eval:
        evaluate(data_loader_val, model, device, use_amp=args.fp16)
        return

    print(f"Start training for {args.epochs} epochs")
    start_time = time.time()
    max_accuracy = 0.0
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            data_loader_train.sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, scaler, args,
                                      mixup_fn)
        if args.output_dir:
            save_checkpoint(args, epoch, model_without_ddp, optimizer, scaler, name="checkpoint-last.pth")
        test_stats = evaluate(data_loader_val, model, device, use_amp=args.fp16)
        if test_stats["acc1"] > max_accuracy:
            max_accuracy = test_stats["acc1"]
            if args.output_dir:
                save_checkpoint(args, epoch, model_without_ddp, optimizer, scaler, name="checkpoint-best.pth")
        print(f"Max accuracy: {max_accuracy:.2f}%")
        log_stats = {**{f"train_{k}": v for k, v in train_stats.items()},
                     **{f"test_{k}": v for k, v in test_stats.items()}, "epoch": epoch}
        if args.output_dir and misc.is_main_process():
            with open(os.path.join(args.output_dir, "log.txt"), mode="a", encoding="utf-8") as f:
                f.write(json.dumps(log_stats) + "\n")

    if args.output_dir and misc.is_main_process():
        # compact weights-only release file
        release = {k: v.half() for k, v in model_without_ddp.state_dict().items()}
        torch.save(release, os.path.join(args.output_dir, "release_fp16.pth"))
    total_time = time.time() - start_time
    print(f"Training time {datetime.timedelta(seconds=int(total_time))}")


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
