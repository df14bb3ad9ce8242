"""ImageNet training script in the style of timm's train.py (trimmed)."""
import argparse
import logging
import time
from collections import OrderedDict
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
import torchvision.utils

_logger = logging.getLogger("train")


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

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


class AverageMeter:
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, device, lr_scheduler=None,
                    amp_autocast=suppress, loss_scaler=None, model_ema=None, mixup_fn=None):
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
    optimizer.zero_grad()
    update_sample_count = 0
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        update_idx = batch_idx // accum_steps
        if batch_idx >= last_batch_idx - last_accum_steps:
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
                loss = loss_fn(output, target)
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
                    parameters=model.parameters(),
                    create_graph=second_order,
                    need_update=need_update,
                )
            else:
                _loss.backward(create_graph=second_order)
                if need_update:
                    if args.clip_grad is not None:
                        dispatch_clip_grad(model.parameters(), value=args.clip_grad, mode=args.clip_mode)
                    optimizer.step()

        if has_no_sync and not need_update:
            with model.no_sync():
                loss = _forward()
                _backward(loss)
        else:
            loss = _forward()
            _backward(loss)

        losses_m.update(loss.item() * accum_steps, input.size(0))
        update_sample_count += input.size(0)
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        if model_ema is not None:
            model_ema.update(model, step=num_updates)
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
    return OrderedDict([("loss", losses_m.avg)])


def validate(model, loader, loss_fn, args, device, amp_autocast=suppress, log_suffix=""):
    losses_m = AverageMeter()
    model.eval()
    end = time.time()
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
                loss = loss_fn(output, target)
            losses_m.update(loss.item(), input.size(0))
    return OrderedDict([("loss", losses_m.avg), ("time", time.time() - end)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--amp-dtype", default="float16")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--clip-mode", default="norm")
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--prefetcher", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = torchvision.models.resnet50()
    model.to(device=device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    amp_autocast = suppress
    loss_scaler = None
    if args.amp:
        amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if device.type == "cuda" and amp_dtype == torch.float16:
            loss_scaler = NativeScaler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    train_loss_fn = nn.CrossEntropyLoss().to(device=device)
    validate_loss_fn = nn.CrossEntropyLoss().to(device)
    loader_train = loader_eval = None
    for epoch in range(args.epochs):
        train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args, device,
                        amp_autocast=amp_autocast, loss_scaler=loss_scaler)
        validate(model, loader_eval, validate_loss_fn, args, device, amp_autocast=amp_autocast)


if __name__ == "__main__":
    main()
