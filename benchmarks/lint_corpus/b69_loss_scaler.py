"""Loss-scaler helpers and the training engines built on them (MAE / DeiT style).

``loss_scaler(loss, optimizer, clip_grad=..., parameters=...)`` does backward, optional
clipping, the optimizer step and the scale update in one call.
"""
import argparse
import math
import sys
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import inf, nn

import util.lr_sched as lr_sched
import util.misc as misc
from util.builders import build_dataset, build_model, build_teacher, param_groups_lrd

try:
    from apex import amp as apex_amp
    has_apex = True
except ImportError:
    apex_amp = None
    has_apex = False


def get_grad_norm_(parameters, norm_type: float = 2.0) -> torch.Tensor:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if len(parameters) == 0:
        return torch.tensor(0.0)
    device = parameters[0].grad.device
    if norm_type == inf:
        total_norm = max(p.grad.detach().abs().max().to(device) for p in parameters)
    else:
        total_norm = torch.norm(
            torch.stack([torch.norm(p.grad.detach(), norm_type).to(device) for p in parameters]), norm_type)
    return total_norm


class NativeScalerWithGradNormCount:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if update_grad:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                self._scaler.unscale_(optimizer)
                norm = get_grad_norm_(parameters)
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            norm = None
        return norm

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


class ValueClipScaler:
    """Variant that clips gradient values instead of the norm (ViT-L/H fine-tuning)."""

    state_dict_key = "amp_scaler"

    def __init__(self, init_scale: float = 2.0 ** 16):
        self.scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if not update_grad:
            return None
        if clip_grad is not None:
            torch.nn.utils.clip_grad_value_(parameters, clip_grad)  # expect: AMP005
        self.scaler.step(optimizer)
        self.scaler.update()
        return None

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict):
        self.scaler.load_state_dict(state_dict)


class ApexScaler:
    state_dict_key = "amp"

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        with apex_amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward(create_graph=create_graph)
        if update_grad:
            if clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(apex_amp.master_params(optimizer), clip_grad)
            optimizer.step()

    def state_dict(self):
        return apex_amp.state_dict()

    def load_state_dict(self, state_dict):
        apex_amp.load_state_dict(state_dict)


class DistillationLoss(nn.Module):
    def __init__(self, base_criterion, teacher_model, distillation_type="soft", alpha=0.5, tau=1.0):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == "none":
            return base_loss
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)
        T = self.tau
        if self.distillation_type == "soft":
            distillation_loss = F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1), F.log_softmax(teacher_outputs / T, dim=1),
                reduction="sum", log_target=True) * (T * T) / outputs_kd.numel()
        else:
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler,
                    max_norm: Optional[float] = None, mixup_fn=None, args=None):
    model.train(True)
    metric_logger = misc.MetricLogger(delimiter="  ")
    accum_iter = args.accum_iter
    optimizer.zero_grad()
    for it, (samples, targets) in enumerate(metric_logger.log_every(data_loader, 20, f"Epoch: [{epoch}]")):
        if it % accum_iter == 0:
            lr_sched.adjust_learning_rate(optimizer, it / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)

        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(samples)
            loss = criterion(outputs, targets)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)

        loss /= accum_iter
        grad_norm = loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters(),
                                update_grad=(it + 1) % accum_iter == 0)
        if (it + 1) % accum_iter == 0:
            optimizer.zero_grad()
        torch.cuda.synchronize()
        metric_logger.update(loss=loss_value, lr=optimizer.param_groups[0]["lr"])
        if grad_norm is not None:
            metric_logger.update(grad_norm=grad_norm.item())
    metric_logger.synchronize_between_processes()
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


def train_one_epoch_distill(model, criterion: DistillationLoss, data_loader, optimizer, device, epoch,
                            loss_scaler, max_norm: Optional[float] = None, args=None):
    model.train(True)
    metric_logger = misc.MetricLogger(delimiter="  ")
    for samples, targets in metric_logger.log_every(data_loader, 20, f"Distill: [{epoch}]"):
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(samples)
            loss = criterion(samples, outputs, targets)
            loss_value = loss.item()
            loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters())  # expect: AMP008
        metric_logger.update(loss=loss_value, lr=optimizer.param_groups[0]["lr"])
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


def pretrain_mae_epoch(model, data_loader, optimizer, scaler, device, epoch, args):
    model.train(True)
    metric_logger = misc.MetricLogger(delimiter="  ")
    for it, (samples, _) in enumerate(metric_logger.log_every(data_loader, 20, f"MAE: [{epoch}]")):
        lr_sched.adjust_learning_rate(optimizer, it / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _, _ = model(samples, mask_ratio=args.mask_ratio)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
        scaler.step(optimizer)
        scaler.update()
        metric_logger.update(loss=loss.item(), grad_norm=grad_norm.item())
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


def train_one_epoch_detection(model, optimizer, data_loader, device, epoch, scaler=None, print_freq=20):
    """torchvision detection reference loop."""
    model.train()
    metric_logger = misc.MetricLogger(delimiter="  ")
    for images, targets in metric_logger.log_every(data_loader, print_freq, f"Det: [{epoch}]"):
        images = [img.to(device) for img in images]
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", enabled=scaler is not None):
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())
        loss_value = losses.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training", loss_dict)
            sys.exit(1)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
        optimizer.step()  # expect: AMP006
        metric_logger.update(loss=loss_value, **{k: v.item() for k, v in loss_dict.items()})
    return metric_logger


@torch.no_grad()
def evaluate(data_loader, model, device):
    criterion = torch.nn.CrossEntropyLoss()
    metric_logger = misc.MetricLogger(delimiter="  ")
    model.eval()
    for images, target in metric_logger.log_every(data_loader, 10, "Test:"):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            loss = criterion(output, target)
        acc1 = (output.argmax(-1) == target).float().mean() * 100
        metric_logger.update(loss=loss.item(), acc1=acc1.item())
    return {k: meter.global_avg for k, meter in metric_logger.meters.items()}


def main(args):
    device = torch.device(args.device)
    misc.init_distributed_mode(args)
    data_loader_train, data_loader_val = build_dataset(args)
    model = build_model(args).to(device)
    optimizer = torch.optim.AdamW(param_groups_lrd(model, args.weight_decay), lr=args.lr)

    if args.mode == "pretrain":
        scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
        for epoch in range(args.epochs):
            pretrain_mae_epoch(model, data_loader_train, optimizer, scaler, device, epoch, args)
        return
    if args.mode == "detection":
        scaler = torch.amp.GradScaler("cuda") if args.amp else None
        for epoch in range(args.epochs):
            train_one_epoch_detection(model, optimizer, data_loader_train, device, epoch, scaler)
        return

    if args.apex and has_apex:
        loss_scaler = ApexScaler()
    elif args.clip_mode == "value":
        loss_scaler = ValueClipScaler()
    else:
        loss_scaler = NativeScalerWithGradNormCount()
    misc.load_model(args=args, model_without_ddp=model, optimizer=optimizer, loss_scaler=loss_scaler)

    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    for epoch in range(args.start_epoch, args.epochs):
        if args.teacher:
            distill_criterion = DistillationLoss(criterion, build_teacher(args).to(device).eval(),
                                                 args.distillation_type, args.distillation_alpha)
            train_one_epoch_distill(model, distill_criterion, data_loader_train, optimizer, device, epoch,
                                    loss_scaler, args.clip_grad, args=args)
        else:
            train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, loss_scaler,
                            args.clip_grad, args=args)
        stats = evaluate(data_loader_val, model, device)
        print(f"epoch {epoch}: top1 {stats['acc1']:.2f}")
        misc.save_model(args=args, model=model, optimizer=optimizer, loss_scaler=loss_scaler, epoch=epoch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser("engine")
    parser.add_argument("--mode", default="finetune", choices=["finetune", "pretrain", "detection"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--start-epoch", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--accum-iter", type=int, default=1)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--clip-mode", default="norm", choices=["norm", "value"])
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--mask-ratio", type=float, default=0.75)
    parser.add_argument("--teacher", default=None)
    parser.add_argument("--distillation-type", default="soft")
    parser.add_argument("--distillation-alpha", type=float, default=0.5)
    parser.add_argument("--apex", action="store_true")
    parser.add_argument("--amp", action="store_true")
    main(parser.parse_args())
