"""mmcv/mmengine-style runner with optimizer hooks, a classification head with focal loss, and an fp16 hook."""
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad

logger = logging.getLogger(__name__)


class Hook:
    priority = "NORMAL"

    def before_run(self, runner):
        pass

    def after_train_iter(self, runner):
        pass


class FocalHead(nn.Module):
    def __init__(self, in_channels, num_classes, gamma=2.0, alpha=0.25):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 256, 3, padding=1)
        self.fc_cls = nn.Linear(256, num_classes)
        self.fc_obj = nn.Linear(256, 1)
        self.gamma = gamma
        self.alpha = alpha
        self.loss_obj = nn.BCELoss(reduction="mean")

    @torch.autocast(device_type="cuda", dtype=torch.float16)
    def forward(self, x):
        x = F.relu(self.conv(x))
        x = x.mean(dim=[2, 3])  # expect: AMP004
        return self.fc_cls(x), self.fc_obj(x)

    def loss(self, feats, labels, objectness):
        cls_score, obj_logit = self(feats)
        p = torch.sigmoid(cls_score)
        target = F.one_hot(labels, cls_score.size(-1)).float()
        pt = torch.where(target == 1, p, 1 - p)
        w = self.alpha * target + (1 - self.alpha) * (1 - target)
        focal = -w * (1 - pt).pow(self.gamma) * torch.log(pt + 1e-12)  # expect: AMP011
        loss_cls = focal.sum() / max(1.0, float(labels.numel()))
        loss_obj = self.loss_obj(torch.sigmoid(obj_logit).squeeze(-1), objectness)  # expect: AMP003
        return dict(loss_cls=loss_cls, loss_obj=loss_obj)


def parse_losses(losses):
    log_vars = {k: v.mean() for k, v in losses.items()}
    loss = sum(v for k, v in log_vars.items() if "loss" in k)
    return loss, {k: v.item() for k, v in log_vars.items()}


class OptimizerHook(Hook):
    def __init__(self, grad_clip=None):
        self.grad_clip = grad_clip

    def clip_grads(self, params):
        params = list(filter(lambda p: p.requires_grad and p.grad is not None, params))
        if len(params) > 0:
            return clip_grad.clip_grad_norm_(params, **self.grad_clip)

    def after_train_iter(self, runner):
        runner.optimizer.zero_grad()
        runner.outputs["loss"].backward()
        if self.grad_clip is not None:
            grad_norm = self.clip_grads(runner.model.parameters())
            if grad_norm is not None:
                runner.log_buffer.update({"grad_norm": float(grad_norm)})
        runner.optimizer.step()


class GradScalerOptimizerHook(OptimizerHook):
    """Native-AMP hook: the runner's train_step produced the loss under autocast."""

    def __init__(self, grad_clip=None, init_scale=2.0**16):
        super().__init__(grad_clip)
        self.loss_scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)

    def after_train_iter(self, runner):
        runner.optimizer.zero_grad()
        self.loss_scaler.scale(runner.outputs["loss"]).backward()
        if self.grad_clip is not None:
            grad_norm = self.clip_grads(runner.model.parameters())  # expect: AMP005
            if grad_norm is not None:
                runner.log_buffer.update({"grad_norm": float(grad_norm)})
        self.loss_scaler.step(runner.optimizer)
        self.loss_scaler.update()
        runner.meta.setdefault("fp16", {})["loss_scaler"] = self.loss_scaler.state_dict()


class GradientCumulativeFp16Hook(OptimizerHook):
    def __init__(self, cumulative_iters=4, grad_clip=None):
        super().__init__(grad_clip)
        self.cumulative_iters = cumulative_iters
        self.scaler = torch.amp.GradScaler("cuda")

    def after_train_iter(self, runner):
        loss = runner.outputs["loss"] / self.cumulative_iters
        self.scaler.scale(loss).backward()
        if (runner.iter + 1) % self.cumulative_iters == 0:
            if self.grad_clip is not None:
                self.scaler.unscale_(runner.optimizer)
                self.clip_grads(runner.model.parameters())
            self.scaler.step(runner.optimizer)  # expect: AMP006
            runner.optimizer.zero_grad()


class EpochBasedRunner:
    def __init__(self, model: FocalHead, optimizer, hooks, fp16=True):
        self.model = model
        self.optimizer = optimizer
        self.hooks = hooks
        self.fp16 = fp16
        self.iter = 0
        self.meta = {}
        self.outputs = {}
        self.log_buffer = {}

    def train_step(self, data):
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.fp16):
            losses = self.model.loss(data["img"], data["label"], data["obj"])
        loss, log_vars = parse_losses(losses)
        return dict(loss=loss, log_vars=log_vars, num_samples=data["img"].size(0))

    def run_epoch(self, data_loader):
        self.model.train()
        for data in data_loader:
            self.outputs = self.train_step(data)
            for hook in self.hooks:
                hook.after_train_iter(self)
            self.iter += 1


class SimpleFp16Runner(EpochBasedRunner):
    """A trimmed runner for quick finetuning jobs, without hooks."""

    def run_epoch(self, data_loader):
        self.model.train()
        for data in data_loader:
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                losses = self.model.loss(data["img"], data["label"], data["obj"])
            loss, _ = parse_losses(losses)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.iter += 1


def build_runner(cfg):
    model = FocalHead(cfg.in_channels, cfg.num_classes).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4)
    if cfg.fp16:
        hooks = [GradScalerOptimizerHook(grad_clip=dict(max_norm=35, norm_type=2))]
    else:
        hooks = [OptimizerHook(grad_clip=dict(max_norm=35, norm_type=2))]
    return EpochBasedRunner(model, optimizer, hooks, fp16=cfg.fp16)
