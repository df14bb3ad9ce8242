#!/usr/bin/env python3
""" ImageNet Training Script

Fork of the timm reference training script with logit distillation from a
frozen teacher, kept in-tree so the clipping and scaler code can be patched
without a timm release.

Hacked together by / Copyright 2020 Ross Wightman (https://github.com/rwightman)
"""
import argparse
import logging
import os
import time
from collections import OrderedDict
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from timm import utils
from timm.data import create_dataset, create_loader, resolve_data_config, Mixup, FastCollateMixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import create_model, model_parameters, load_checkpoint
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import AverageMeter, ModelEmaV3, accuracy

_logger = logging.getLogger("train")


def unitwise_norm(x, norm_type=2.0):
    if x.ndim <= 1:
        return x.norm(norm_type)
    return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for p in parameters:
        if p.grad is None:
            continue
        p_data = p.detach()
        g_data = p.grad.detach()
        max_norm = unitwise_norm(p_data, norm_type=norm_type).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data, norm_type=norm_type)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        p.grad.detach().copy_(new_grads)


def dispatch_clip_grad(parameters, value: float, mode: str = "norm", norm_type: float = 2.0):
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
    elif mode == "agc":
        adaptive_clip_grad(parameters, value, norm_type=norm_type)
    else:
        assert False, f"Unknown clip mode ({mode})."


class NativeScaler:
    """torch.amp.GradScaler wrapper (was torch.cuda.amp.GradScaler before torch 2.4) with optional clipping."""

    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False,
                 need_update=True):
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


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, device=torch.device("cuda"), lr_scheduler=None,
                    amp_autocast=suppress, loss_scaler=None, model_ema=None, mixup_fn=None, teacher=None):
    if args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
        if args.prefetcher and loader.mixup_enabled:
            loader.mixup_enabled = False
        elif mixup_fn is not None:
            mixup_fn.mixup_enabled = False

    second_order = hasattr(optimizer, "is_second_order") and optimizer.is_second_order
    has_no_sync = hasattr(model, "no_sync")
    update_time_m = AverageMeter()
    losses_m = AverageMeter()

    model.train()
    accum_steps = args.grad_accum_steps
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps

    update_start_time = time.time()
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps

        if not args.prefetcher:
            input, target = input.to(device), target.to(device)
            if mixup_fn is not None:
                input, target = mixup_fn(input, target)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)

        def _forward():
            with amp_autocast():
                output = model(input)
            if teacher is not None:
                with torch.no_grad(), amp_autocast():
                    teacher_logits = teacher(input)
            loss = loss_fn(output, target)  # expect: AMP002
            if teacher is not None:
                T = args.kd_temperature
                kd = F.kl_div(F.log_softmax(output.float() / T, dim=-1), F.log_softmax(teacher_logits.float() / T, dim=-1),
                              reduction="batchmean", log_target=True)
                loss = (1.0 - args.kd_alpha) * loss + args.kd_alpha * (T * T) * kd
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss):
            if loss_scaler is not None:
                loss_scaler(
                    _loss,
                    optimizer,
                    clip_grad=args.clip_grad,
                    clip_mode=args.clip_mode,
                    parameters=model_parameters(model, exclude_head="agc" in args.clip_mode),
                    create_graph=second_order,
                    need_update=need_update,
                )
            else:
                _loss.backward(create_graph=second_order)
                if need_update:
                    if args.clip_grad is not None:
                        dispatch_clip_grad(
                            model_parameters(model, exclude_head="agc" in args.clip_mode),
                            value=args.clip_grad,
                            mode=args.clip_mode,
                        )
                    optimizer.step()

        if has_no_sync and not need_update:
            with model.no_sync():
                loss = _forward()
                _backward(loss)
        else:
            loss = _forward()
            _backward(loss)

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
        if last_batch or num_updates % args.log_interval == 0:
            lrl = [param_group["lr"] for param_group in optimizer.param_groups]
            lr = sum(lrl) / len(lrl)
            if utils.is_primary(args):
                _logger.info(f"Train: {epoch} [{num_updates:>6d}] Loss: {losses_m.val:#.3g} ({losses_m.avg:#.3g}) "
                             f"Time: {update_time_m.val:.3f}s LR: {lr:.3e}")
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)

    return OrderedDict([("loss", losses_m.avg)])


def validate(model, loader, loss_fn, args, device=torch.device("cuda"), amp_autocast=suppress, log_suffix=""):
    losses_m = AverageMeter()
    top1_m = AverageMeter()
    top5_m = AverageMeter()
    model.eval()
    with torch.no_grad():
        for batch_idx, (input, target) in enumerate(loader):
            if not args.prefetcher:
                input = input.to(device)
                target = target.to(device)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(input)
                if isinstance(output, (tuple, list)):
                    output = output[0]
                reduce_factor = args.tta
                if reduce_factor > 1:
                    output = output.unfold(0, reduce_factor, reduce_factor).mean(dim=2)
                    target = target[0 : target.size(0) : reduce_factor]
                loss = loss_fn(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            if args.distributed:
                reduced_loss = utils.reduce_tensor(loss.data, args.world_size)
                acc1 = utils.reduce_tensor(acc1, args.world_size)
                acc5 = utils.reduce_tensor(acc5, args.world_size)
            else:
                reduced_loss = loss.data
            losses_m.update(reduced_loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
            top5_m.update(acc5.item(), output.size(0))
    _logger.info(f"Test{log_suffix}: Loss {losses_m.avg:>6.3f} Acc@1 {top1_m.avg:>7.3f} Acc@5 {top5_m.avg:>7.3f}")
    return OrderedDict([("loss", losses_m.avg), ("top1", top1_m.avg), ("top5", top5_m.avg)])


def main(args):
    utils.setup_default_logging()
    device = utils.init_distributed_device(args)
    utils.random_seed(args.seed, args.rank)

    use_amp = None
    amp_dtype = torch.float16
    if args.amp:
        use_amp = "native"
        if args.amp_dtype == "bfloat16":
            amp_dtype = torch.bfloat16

    model = create_model(args.model, pretrained=args.pretrained, num_classes=args.num_classes,
                         drop_rate=args.drop, drop_path_rate=args.drop_path, **args.model_kwargs)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(enable=True)
    model.to(device=device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    teacher = None
    if args.teacher:
        teacher = create_model(args.teacher, pretrained=True, num_classes=args.num_classes)
        teacher.requires_grad_(False)
        teacher.eval()
        teacher.to(device=device)
        if args.teacher_half:
            teacher.half()

    optimizer = create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **args.opt_kwargs)

    amp_autocast = suppress
    loss_scaler = None
    if use_amp == "native":
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if device.type == "cuda" and amp_dtype == torch.float16:
            loss_scaler = NativeScaler()
        _logger.info("Using native Torch AMP. Training in mixed precision.")
    else:
        _logger.info("AMP not enabled. Training in float32.")

    model_ema = None
    if args.model_ema:
        model_ema = ModelEmaV3(model, decay=args.model_ema_decay, device="cpu" if args.model_ema_force_cpu else None)
        if args.resume:
            load_checkpoint(model_ema.module, args.resume, use_ema=True)

    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device])

    dataset_train = create_dataset(args.dataset, root=args.data_dir, split=args.train_split, is_training=True)
    dataset_eval = create_dataset(args.dataset, root=args.data_dir, split=args.val_split, is_training=False)

    collate_fn = None
    mixup_fn = None
    mixup_active = args.mixup > 0 or args.cutmix > 0.0 or args.cutmix_minmax is not None
    if mixup_active:
        mixup_args = dict(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                          prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                          label_smoothing=args.smoothing, num_classes=args.num_classes)
        if args.prefetcher:
            collate_fn = FastCollateMixup(**mixup_args)
        else:
            mixup_fn = Mixup(**mixup_args)

    data_config = resolve_data_config(vars(args), model=model, verbose=utils.is_primary(args))
    loader_train = create_loader(dataset_train, input_size=data_config["input_size"], batch_size=args.batch_size,
                                 is_training=True, collate_fn=collate_fn, num_workers=args.workers,
                                 distributed=args.distributed, device=device, use_prefetcher=args.prefetcher)
    loader_eval = create_loader(dataset_eval, input_size=data_config["input_size"], batch_size=args.batch_size,
                                is_training=False, num_workers=args.workers, distributed=args.distributed,
                                device=device, use_prefetcher=args.prefetcher)

    if mixup_active:
        train_loss_fn = SoftTargetCrossEntropy()
    elif args.smoothing:
        train_loss_fn = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        train_loss_fn = nn.CrossEntropyLoss()
    train_loss_fn = train_loss_fn.to(device=device)
    validate_loss_fn = nn.CrossEntropyLoss().to(device=device)

    updates_per_epoch = (len(loader_train) + args.grad_accum_steps - 1) // args.grad_accum_steps
    lr_scheduler, num_epochs = create_scheduler_v2(optimizer, **scheduler_kwargs(args),
                                                   updates_per_epoch=updates_per_epoch)
    output_dir = utils.get_outdir(args.output or "./output/train", args.experiment)
    saver = utils.CheckpointSaver(model=model, optimizer=optimizer, args=args, model_ema=model_ema,
                                  amp_scaler=loss_scaler, checkpoint_dir=output_dir, decreasing=False)
    with open(os.path.join(output_dir, "args.yaml"), "w") as f:
        f.write(yaml.safe_dump(vars(args), default_flow_style=False))

    best_metric, best_epoch = None, None
    for epoch in range(args.start_epoch, num_epochs):
        if hasattr(dataset_train, "set_epoch"):
            dataset_train.set_epoch(epoch)
        train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args, device=device,
                        lr_scheduler=lr_scheduler, amp_autocast=amp_autocast, loss_scaler=loss_scaler,
                        model_ema=model_ema, mixup_fn=mixup_fn, teacher=teacher)
        eval_metrics = validate(model, loader_eval, validate_loss_fn, args, device=device, amp_autocast=amp_autocast)
        if model_ema is not None and not args.model_ema_force_cpu:
            eval_metrics = validate(model_ema, loader_eval, validate_loss_fn, args, device=device,
                                    amp_autocast=amp_autocast, log_suffix=" (EMA)")
        if lr_scheduler is not None:
            lr_scheduler.step(epoch + 1, eval_metrics["top1"])
        best_metric, best_epoch = saver.save_checkpoint(epoch, metric=eval_metrics["top1"])
    if best_metric is not None:
        _logger.info("*** Best metric: {0} (epoch {1})".format(best_metric, best_epoch))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
    parser.add_argument("--config", default="", type=str, help="YAML config file specifying default arguments")
    args = parser.parse_args()
    with open(args.config) as f:
        parser.set_defaults(**yaml.safe_load(f))
    main(parser.parse_args([]))
