#!/usr/bin/env python3
""" ImageNet training script (timm layout) with optional knowledge distillation.

Examples:
    ./distributed_train.sh 8 b80_timm_train.py /data/imagenet --model resnet50 --amp -b 256 --lr 0.6
    python b80_timm_train.py /data/imagenet --model vit_small_patch16_224 --amp --amp-dtype bfloat16 \
        --kd-teacher regnety_160 --kd-weight 0.5 --clip-grad 1.0
"""
import argparse
import logging
import os
import time
from collections import OrderedDict
from contextlib import suppress
from datetime import datetime
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm_lite.data import create_dataset, create_loader, resolve_data_config, Mixup
from timm_lite.loss import SoftTargetCrossEntropy
from timm_lite.models import create_model, resume_checkpoint, model_parameters
from timm_lite.optim import create_optimizer_v2
from timm_lite.scheduler import create_scheduler_v2
from timm_lite.utils import (AverageMeter, CheckpointSaver, ModelEmaV3, accuracy, adaptive_clip_grad,
                             reduce_tensor, setup_default_logging, update_summary)

_logger = logging.getLogger("train")

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("data_dir", metavar="DIR")
parser.add_argument("--model", default="resnet50", type=str)
parser.add_argument("--pretrained", action="store_true", default=False)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("-b", "--batch-size", type=int, default=128)
parser.add_argument("--grad-accum-steps", type=int, default=1)
parser.add_argument("--opt", default="sgd", type=str)
parser.add_argument("--lr", type=float, default=None)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--weight-decay", type=float, default=2e-5)
parser.add_argument("--clip-grad", type=float, default=None)
parser.add_argument("--clip-mode", type=str, default="norm", help='"norm", "value", or "agc"')
parser.add_argument("--epochs", type=int, default=300)
parser.add_argument("--smoothing", type=float, default=0.1)
parser.add_argument("--mixup", type=float, default=0.0)
parser.add_argument("--cutmix", type=float, default=0.0)
parser.add_argument("--model-ema", action="store_true", default=False)
parser.add_argument("--model-ema-decay", type=float, default=0.9998)
parser.add_argument("--kd-teacher", default="", type=str)
parser.add_argument("--kd-temperature", type=float, default=1.0)
parser.add_argument("--kd-weight", type=float, default=0.5)
parser.add_argument("--amp", action="store_true", default=False)
parser.add_argument("--amp-dtype", default="float16", type=str)
parser.add_argument("--channels-last", action="store_true", default=False)
parser.add_argument("--torchcompile", action="store_true", default=False)
parser.add_argument("--benchmark-steps", type=int, default=0, help="only measure training throughput")
parser.add_argument("--tta", type=int, default=0)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--no-resume-opt", action="store_true", default=False)
parser.add_argument("--output", default="./output", type=str)
parser.add_argument("--log-interval", type=int, default=50)
parser.add_argument("--device", default="cuda", type=str)


def dispatch_clip_grad(parameters, value, mode="norm", norm_type=2.0):
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
    elif mode == "agc":
        adaptive_clip_grad(parameters, value, norm_type=norm_type)
    else:
        assert False, f"Unknown clip mode ({mode})."


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        try:
            self._scaler = torch.amp.GradScaler(device)
        except (AttributeError, TypeError):
            self._scaler = torch.cuda.amp.GradScaler()

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's params in-place
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, device, lr_scheduler=None,
                    amp_autocast=suppress, loss_scaler=None, model_ema=None, mixup_fn=None, teacher=None):
    second_order = hasattr(optimizer, "is_second_order") and optimizer.is_second_order
    accum_steps = args.grad_accum_steps
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps

    losses_m = AverageMeter()
    update_time_m = AverageMeter()
    model.train()
    optimizer.zero_grad()
    update_start_time = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        update_idx = batch_idx // accum_steps
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps

        input, target = input.to(device), target.to(device)
        if mixup_fn is not None:
            input, target = mixup_fn(input, target)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)

        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)
            if teacher is not None:
                with torch.no_grad():
                    teacher_output = teacher(input)

        if teacher is not None:
            T = args.kd_temperature
            kd_loss = F.kl_div(F.log_softmax(output / T, dim=-1), F.log_softmax(teacher_output / T, dim=-1), reduction="batchmean", log_target=True)  # expect: AMP002
            loss = (1.0 - args.kd_weight) * loss + args.kd_weight * kd_loss * (T * T)
        if accum_steps > 1:
            loss /= accum_steps

        if loss_scaler is not None:
            loss_scaler(
                loss, optimizer,
                clip_grad=args.clip_grad,
                clip_mode=args.clip_mode,
                parameters=model_parameters(model, exclude_head="agc" in args.clip_mode),
                create_graph=second_order,
                need_update=need_update,
            )
        else:
            loss.backward(create_graph=second_order)
            if need_update:
                if args.clip_grad is not None:
                    dispatch_clip_grad(
                        model_parameters(model, exclude_head="agc" in args.clip_mode),
                        value=args.clip_grad,
                        mode=args.clip_mode,
                    )
                optimizer.step()

        losses_m.update(loss.item() * accum_steps, input.size(0))
        if not need_update:
            continue

        num_updates += 1
        optimizer.zero_grad()
        if model_ema is not None:
            model_ema.update(model, step=num_updates)

        time_now = time.time()
        update_time_m.update(time.time() - update_start_time)
        update_start_time = time_now
        if update_idx % args.log_interval == 0:
            lrl = [param_group["lr"] for param_group in optimizer.param_groups]
            lr = sum(lrl) / len(lrl)
            _logger.info(
                f"Train: {epoch} [{update_idx:>4d}/{updates_per_epoch}] "
                f"Loss: {losses_m.val:#.3g} ({losses_m.avg:#.3g})  LR: {lr:.3e}  "
                f"Time: {update_time_m.val:.3f}s"
            )
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)

    return OrderedDict([("loss", losses_m.avg)])


def validate(model, loader, loss_fn, args, device, amp_autocast=suppress, log_suffix=""):
    losses_m, top1_m, top5_m = AverageMeter(), AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for batch_idx, (input, target) in enumerate(loader):
            input, target = input.to(device), target.to(device)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(input)
                if isinstance(output, (tuple, list)):
                    output = output[0]
                # augmentation reduction
                reduce_factor = args.tta
                if reduce_factor > 1:
                    output = output.unfold(0, reduce_factor, reduce_factor).mean(dim=2)
                    target = target[0:target.size(0):reduce_factor]
                loss = loss_fn(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
            top5_m.update(acc5.item(), output.size(0))
    _logger.info(f"Test{log_suffix}: Loss {losses_m.avg:>7.3f}  Acc@1 {top1_m.avg:>7.3f}  Acc@5 {top5_m.avg:>7.3f}")
    return OrderedDict([("loss", losses_m.avg), ("top1", top1_m.avg), ("top5", top5_m.avg)])


def benchmark_train_throughput(model, loader, optimizer, loss_fn, device, amp_autocast=suppress,
                               loss_scaler=None, num_steps=50, warmup_steps=10):
    """Images/sec of the full fwd+bwd+step; numbers are not comparable across --amp-dtype."""
    model.train()
    seen, t0 = 0, None
    for step, (x, y) in enumerate(loader):
        if step == warmup_steps:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        if step >= warmup_steps + num_steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with amp_autocast():
            output = model(x)
            loss = loss_fn(output, y)
            if loss_scaler is not None:
                loss_scaler(loss, optimizer)  # expect: AMP008
            else:
                loss.backward()  # expect: AMP008
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if t0 is not None:
            seen += x.size(0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    _logger.info(f"Train benchmark: {seen / elapsed:.1f} img/s over {num_steps} steps")
    return seen / elapsed


def main():
    setup_default_logging()
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True

    use_amp = args.amp
    amp_dtype = torch.float16
    if args.amp_dtype == "bfloat16":
        amp_dtype = torch.bfloat16

    model = create_model(args.model, pretrained=args.pretrained, num_classes=args.num_classes)
    model.to(device=device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    _logger.info(f"Model {args.model} created, param count: {sum(m.numel() for m in model.parameters())}")

    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    momentum=args.momentum)

    amp_autocast = suppress  # do nothing
    loss_scaler = None
    if use_amp:
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if device.type == "cuda" and amp_dtype == torch.float16:
            # loss scaler only used for float16 (half) dtype, bfloat16 does not need it
            loss_scaler = NativeScaler()
        _logger.info("Using native Torch AMP. Training in mixed precision.")
    else:
        _logger.info("AMP not enabled. Training in float32.")

    teacher = None
    if args.kd_teacher:
        teacher = create_model(args.kd_teacher, pretrained=True, num_classes=args.num_classes)
        teacher.requires_grad_(False)
        teacher.to(device).eval()

    resume_epoch = None
    if args.resume:
        resume_epoch = resume_checkpoint(
            model, args.resume,
            optimizer=None if args.no_resume_opt else optimizer,
            loss_scaler=None if args.no_resume_opt else loss_scaler,
        )

    model_ema = ModelEmaV3(model, decay=args.model_ema_decay, device=device) if args.model_ema else None
    if args.torchcompile:
        model = torch.compile(model)

    dataset_train = create_dataset("", root=args.data_dir, split="train", is_training=True)
    dataset_eval = create_dataset("", root=args.data_dir, split="validation", is_training=False)
    data_config = resolve_data_config(vars(args), model=model)
    loader_train = create_loader(dataset_train, input_size=data_config["input_size"], batch_size=args.batch_size,
                                 is_training=True, num_workers=8)
    loader_eval = create_loader(dataset_eval, input_size=data_config["input_size"], batch_size=args.batch_size,
                                is_training=False, num_workers=8)

    mixup_fn = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                         num_classes=args.num_classes)
        train_loss_fn = SoftTargetCrossEntropy()
    else:
        train_loss_fn = nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    train_loss_fn = train_loss_fn.to(device=device)
    validate_loss_fn = nn.CrossEntropyLoss().to(device=device)

    if args.benchmark_steps:
        benchmark_train_throughput(model, loader_train, optimizer, train_loss_fn, device,
                                   amp_autocast=amp_autocast, loss_scaler=loss_scaler,
                                   num_steps=args.benchmark_steps)
        return

    updates_per_epoch = (len(loader_train) + args.grad_accum_steps - 1) // args.grad_accum_steps
    lr_scheduler, num_epochs = create_scheduler_v2(optimizer, num_epochs=args.epochs,
                                                   updates_per_epoch=updates_per_epoch)
    start_epoch = resume_epoch if resume_epoch is not None else 0

    exp_name = "-".join([datetime.now().strftime("%Y%m%d-%H%M%S"), args.model])
    output_dir = os.path.join(args.output, exp_name)
    os.makedirs(output_dir, exist_ok=True)
    saver = CheckpointSaver(model=model, optimizer=optimizer, args=args, model_ema=model_ema,
                            amp_scaler=loss_scaler, checkpoint_dir=output_dir, decreasing=False)

    best_metric, best_epoch = None, None
    for epoch in range(start_epoch, num_epochs):
        train_metrics = train_one_epoch(
            epoch, model, loader_train, optimizer, train_loss_fn, args, device,
            lr_scheduler=lr_scheduler, amp_autocast=amp_autocast, loss_scaler=loss_scaler,
            model_ema=model_ema, mixup_fn=mixup_fn, teacher=teacher,
        )
        eval_metrics = validate(model, loader_eval, validate_loss_fn, args, device, amp_autocast=amp_autocast)
        if model_ema is not None:
            ema_eval_metrics = validate(model_ema, loader_eval, validate_loss_fn, args, device,
                                        amp_autocast=amp_autocast, log_suffix=" (EMA)")
            eval_metrics = ema_eval_metrics
        lr_scheduler.step(epoch + 1, eval_metrics["top1"])
        update_summary(epoch, train_metrics, eval_metrics, filename=os.path.join(output_dir, "summary.csv"))
        best_metric, best_epoch = saver.save_checkpoint(epoch, metric=eval_metrics["top1"])

    if best_metric is not None:
        _logger.info(f"*** Best metric: {best_metric} (epoch {best_epoch})")


if __name__ == "__main__":
    main()
