""" ImageNet training loop with optional knowledge distillation (timm-style). """
import argparse
import logging
import time
from collections import OrderedDict
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import create_loader, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.models import create_model
from timm.utils import AverageMeter, ModelEmaV2, accuracy, dispatch_clip_grad

_logger = logging.getLogger("train")

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training with KD")
parser.add_argument("--model", default="resnet50", type=str)
parser.add_argument("--teacher", default="", type=str)
parser.add_argument("--kd-weight", default=1.0, type=float)
parser.add_argument("--kd-temperature", default=4.0, type=float)
parser.add_argument("--amp", action="store_true", default=False)
parser.add_argument("--amp-dtype", default="float16", type=str)
parser.add_argument("--clip-grad", type=float, default=None)
parser.add_argument("--clip-mode", type=str, default="norm")
parser.add_argument("--channels-last", action="store_true", default=False)
parser.add_argument("--model-ema", action="store_true", default=False)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--epochs", type=int, default=100)


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False):
        self._scaler.scale(loss).backward(create_graph=create_graph)
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


def kd_loss(student_logits, teacher_logits, temperature=1.0):
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    return F.kl_div(s, t, reduction="batchmean", log_target=True) * temperature ** 2


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, amp_autocast=suppress, loss_scaler=None, model_ema=None, teacher=None):
    batch_time_m = AverageMeter()
    losses_m = AverageMeter()
    model.train()
    end = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        input, target = input.cuda(non_blocking=True), target.cuda(non_blocking=True)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        if teacher is not None:
            with torch.no_grad(), amp_autocast():
                teacher_output = teacher(input)
        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)
        if teacher is not None:
            loss = loss + args.kd_weight * kd_loss(output, teacher_output, args.kd_temperature)  # expect: AMP002
        losses_m.update(loss.item(), input.size(0))

        optimizer.zero_grad()
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, clip_mode=args.clip_mode, parameters=model.parameters())
        else:
            loss.backward()
            if args.clip_grad is not None:
                dispatch_clip_grad(model.parameters(), value=args.clip_grad, mode=args.clip_mode)
            optimizer.step()
        if model_ema is not None:
            model_ema.update(model)
        torch.cuda.synchronize()
        batch_time_m.update(time.time() - end)
        end = time.time()
        if batch_idx % 50 == 0:
            _logger.info(f"Train: {epoch} [{batch_idx}/{len(loader)}] Loss: {losses_m.val:.4f} ({losses_m.avg:.4f})")
    return OrderedDict([("loss", losses_m.avg)])


def validate(model, loader, loss_fn, amp_autocast=suppress):
    losses_m, top1_m, top5_m = AverageMeter(), AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for input, target in loader:
            input, target = input.cuda(), target.cuda()
            with amp_autocast():
                output = model(input)
                if isinstance(output, (tuple, list)):
                    output = output[0]
            # reduce in fp32 so the validation loss is comparable across precisions
            loss = loss_fn(output.float(), target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
            top5_m.update(acc5.item(), output.size(0))
    return OrderedDict([("loss", losses_m.avg), ("top1", top1_m.avg), ("top5", top5_m.avg)])


def main():
    args = parser.parse_args()
    model = create_model(args.model, pretrained=False).cuda()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    teacher = None
    if args.teacher:
        teacher = create_model(args.teacher, pretrained=True).cuda().eval()
        teacher.requires_grad_(False)

    amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
    amp_autocast = suppress
    loss_scaler = None
    if args.amp:
        amp_autocast = partial(torch.cuda.amp.autocast, dtype=amp_dtype)  # expect: AMP009
        if amp_dtype == torch.float16:
            loss_scaler = NativeScaler()
        _logger.info(f"Using native Torch AMP ({amp_dtype}). Training in mixed precision.")

    model_ema = ModelEmaV2(model, decay=0.9998) if args.model_ema else None
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    data_config = resolve_data_config(vars(args), model=model)
    loader_train = create_loader("train", input_size=data_config["input_size"], batch_size=128, is_training=True)
    loader_eval = create_loader("val", input_size=data_config["input_size"], batch_size=256)
    train_loss_fn = LabelSmoothingCrossEntropy(smoothing=0.1).cuda()
    validate_loss_fn = nn.CrossEntropyLoss().cuda()
    for epoch in range(args.epochs):
        train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args, amp_autocast=amp_autocast, loss_scaler=loss_scaler, model_ema=model_ema, teacher=teacher)
        metrics = validate(model, loader_eval, validate_loss_fn, amp_autocast=amp_autocast)
        _logger.info(f"epoch {epoch}: top1 {metrics['top1']:.3f}")


if __name__ == "__main__":
    main()
