#!/usr/bin/env python3
""" ImageNet training script with knowledge distillation and an attribute head.

Adapted from the timm training script, trimmed to the parts this project uses.
"""
import argparse
import logging
import time
from collections import OrderedDict
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.data import Mixup, create_loader, resolve_data_config
from timm.loss import SoftTargetCrossEntropy
from timm.models import create_model
from timm.optim import create_optimizer_v2
from timm.utils import AverageMeter, ModelEmaV2, NativeScaler, accuracy

_logger = logging.getLogger('train')

parser = argparse.ArgumentParser(description='PyTorch ImageNet distillation training')
parser.add_argument('--model', default='resnet50', type=str)
parser.add_argument('--teacher', default='convnext_base', type=str)
parser.add_argument('--num-attrs', type=int, default=40)
parser.add_argument('--attr-weight', type=float, default=0.2)
parser.add_argument('--kd-temp', type=float, default=4.0)
parser.add_argument('--kd-alpha', type=float, default=0.5)
parser.add_argument('--lr', type=float, default=5e-4)
parser.add_argument('--epochs', type=int, default=300)
parser.add_argument('--clip-grad', type=float, default=None)
parser.add_argument('--amp', action='store_true', default=False, help='use mixed precision')
parser.add_argument('--amp-dtype', default='float16', type=str)
parser.add_argument('--model-ema', action='store_true', default=False)
parser.add_argument('--mixup', type=float, default=0.8)
parser.add_argument('--log-interval', type=int, default=50)


def train_one_epoch(
        epoch, model, teacher, attr_head, loader, optimizer, loss_fn, args,
        device=torch.device('cuda'), amp_autocast=suppress, loss_scaler=None,
        model_ema=None, mixup_fn=None):
    batch_time_m = AverageMeter()
    losses_m = AverageMeter()
    model.train()
    attr_head.train()

    end = time.time()
    last_idx = len(loader) - 1
    for batch_idx, (input, target, attrs) in enumerate(loader):
        input, target, attrs = input.to(device), target.to(device), attrs.to(device).float()
        if mixup_fn is not None:
            input, target = mixup_fn(input, target)

        with torch.no_grad():
            with amp_autocast():
                teacher_logits = teacher(input)

        with amp_autocast():
            feats = model.forward_features(input)
            output = model.forward_head(feats)
            attr_probs = torch.sigmoid(attr_head(model.forward_head(feats, pre_logits=True)))
            loss = loss_fn(output, target)
            attr_loss = F.binary_cross_entropy(attr_probs, attrs)  # expect: AMP003

        student_log_probs = F.log_softmax(output / args.kd_temp, dim=-1)
        teacher_log_probs = F.log_softmax(teacher_logits / args.kd_temp, dim=-1)
        kd_loss = F.kl_div(student_log_probs, teacher_log_probs, reduction='batchmean', log_target=True)  # expect: AMP002
        kd_loss = kd_loss * args.kd_temp ** 2
        loss = (1 - args.kd_alpha) * loss + args.kd_alpha * kd_loss + args.attr_weight * attr_loss

        losses_m.update(loss.item(), input.size(0))
        optimizer.zero_grad()
        params = list(model.parameters()) + list(attr_head.parameters())
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=params)
        else:
            loss.backward()
            if args.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
            optimizer.step()

        if model_ema is not None:
            model_ema.update(model)

        if device.type == 'cuda':
            torch.cuda.synchronize()
        batch_time_m.update(time.time() - end)
        if batch_idx == last_idx or batch_idx % args.log_interval == 0:
            lr = optimizer.param_groups[0]['lr']
            _logger.info(
                f'Train: {epoch} [{batch_idx:>4d}/{last_idx}] '
                f'Loss: {losses_m.val:#.3g} ({losses_m.avg:#.3g}) '
                f'Time: {batch_time_m.val:.3f}s LR: {lr:.3e}')
        end = time.time()

    return OrderedDict([('loss', losses_m.avg)])


def validate(model, loader, loss_fn, device=torch.device('cuda'), amp_autocast=suppress):
    losses_m = AverageMeter()
    top1_m = AverageMeter()
    model.eval()
    with torch.no_grad():
        for input, target, _ in loader:
            input, target = input.to(device), target.to(device)
            with amp_autocast():
                output = model(input)
                if isinstance(output, (tuple, list)):
                    output = output[0]
                loss = loss_fn(output, target)
            acc1, _ = accuracy(output, target, topk=(1, 5))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
    return OrderedDict([('loss', losses_m.avg), ('top1', top1_m.avg)])


def main():
    args = parser.parse_args()
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')

    model = create_model(args.model, pretrained=False, num_classes=1000).to(device)
    teacher = create_model(args.teacher, pretrained=True, num_classes=1000).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    attr_head = nn.Linear(model.num_features, args.num_attrs).to(device)

    amp_autocast = suppress
    loss_scaler = None
    if args.amp:
        if device.type == 'cuda':
            amp_dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16
            amp_autocast = partial(torch.autocast, device_type='cuda', dtype=amp_dtype)
            if amp_dtype == torch.float16:
                loss_scaler = NativeScaler()
        else:
            amp_autocast = partial(torch.cpu.amp.autocast, dtype=torch.bfloat16)  # expect: AMP009
        _logger.info('Using mixed precision training.')

    optimizer = create_optimizer_v2([*model.parameters(), *attr_head.parameters()], 'adamw', lr=args.lr)
    model_ema = ModelEmaV2(model, decay=0.9998) if args.model_ema else None

    data_config = resolve_data_config(vars(args), model=model)
    loader_train = create_loader('train', input_size=data_config['input_size'], batch_size=128, is_training=True)
    loader_eval = create_loader('val', input_size=data_config['input_size'], batch_size=256)
    mixup_fn = Mixup(mixup_alpha=args.mixup, num_classes=1000) if args.mixup > 0 else None
    train_loss_fn = SoftTargetCrossEntropy() if mixup_fn is not None else nn.CrossEntropyLoss()
    validate_loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        train_metrics = train_one_epoch(
            epoch, model, teacher, attr_head, loader_train, optimizer, train_loss_fn, args,
            device=device, amp_autocast=amp_autocast, loss_scaler=loss_scaler,
            model_ema=model_ema, mixup_fn=mixup_fn)
        eval_metrics = validate(model, loader_eval, validate_loss_fn, device=device, amp_autocast=amp_autocast)
        if model_ema is not None:
            validate(model_ema.module, loader_eval, validate_loss_fn, device=device, amp_autocast=amp_autocast)
        _logger.info(f'epoch {epoch}: train {train_metrics["loss"]:.4f} val top1 {eval_metrics["top1"]:.2f}')
        torch.save({'epoch': epoch, 'state_dict': model.state_dict()}, f'checkpoint-{epoch}.pth.tar')


if __name__ == '__main__':
    main()
