"""VICReg / Barlow Twins pretraining with timm-style backbone factory and an online linear probe."""
import argparse
import math
from functools import partial
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

_model_entrypoints: Dict[str, Callable[..., nn.Module]] = {}


def register_model(fn):
    _model_entrypoints[fn.__name__] = fn
    return fn


def create_model(model_name, pretrained=False, **kwargs):
    if model_name not in _model_entrypoints:
        raise RuntimeError(f"Unknown model ({model_name})")
    model = _model_entrypoints[model_name](**kwargs)
    if pretrained:
        raise NotImplementedError("pretrained weights are not bundled")
    return model


def create_conv2d(cin, cout, k, stride=1):
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, norm_layer=nn.BatchNorm2d, act_layer=nn.ReLU):
        super().__init__()
        self.conv1 = create_conv2d(inplanes, planes, 3, stride)
        self.bn1 = norm_layer(planes)
        self.act1 = act_layer(inplace=True)
        self.conv2 = create_conv2d(planes, planes, 3)
        self.bn2 = norm_layer(planes)
        self.act2 = act_layer(inplace=True)
        self.downsample = downsample

    def zero_init_last(self):
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return self.act2(x + shortcut)


class ResNet(nn.Module):
    def __init__(self, layers, num_classes=1000, width=64, norm_layer=nn.BatchNorm2d, act_layer=nn.ReLU,
                 zero_init_residual=False):
        super().__init__()
        self.conv1 = create_conv2d(3, width, 7, stride=2)
        self.bn1 = norm_layer(width)
        self.act1 = act_layer(inplace=True)
        inplanes = width
        for i, n in enumerate(layers):
            planes = width * 2 ** i
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or inplanes != planes:
                down = nn.Sequential(create_conv2d(inplanes, planes, 1, stride), norm_layer(planes))
            blocks = [BasicBlock(inplanes, planes, stride, down, norm_layer, act_layer)]
            blocks += [BasicBlock(planes, planes, norm_layer=norm_layer, act_layer=act_layer) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
            inplanes = planes
        self.num_features = inplanes
        self.fc = nn.Linear(inplanes, num_classes) if num_classes > 0 else nn.Identity()
        if zero_init_residual:
            for m in self.modules():
                if hasattr(m, "zero_init_last"):
                    m.zero_init_last()

    def forward_features(self, x):
        x = F.max_pool2d(self.act1(self.bn1(self.conv1(x))), 3, 2, 1)
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return x

    def forward_head(self, x, pre_logits=False):
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return x if pre_logits else self.fc(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


def _create_resnet(variant, layers, **kwargs):
    kwargs.setdefault("norm_layer", partial(nn.BatchNorm2d, eps=1e-5, momentum=0.1))
    return ResNet(layers, **kwargs)


@register_model
def resnet18(**kwargs):
    return _create_resnet("resnet18", [2, 2, 2, 2], **kwargs)


@register_model
def resnet34(**kwargs):
    return _create_resnet("resnet34", [3, 4, 6, 3], **kwargs)


@register_model
def resnet18_silu(**kwargs):
    return _create_resnet("resnet18_silu", [2, 2, 2, 2], act_layer=nn.SiLU, **kwargs)


def Projector(args, embedding):
    mlp_spec = f"{embedding}-{args.mlp}"
    layers = []
    f = list(map(int, mlp_spec.split("-")))
    for i in range(len(f) - 2):
        layers.append(nn.Linear(f[i], f[i + 1]))
        layers.append(nn.BatchNorm1d(f[i + 1]))
        layers.append(nn.ReLU(True))
    layers.append(nn.Linear(f[-2], f[-1], bias=False))
    return nn.Sequential(*layers)


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class VICReg(nn.Module):
    """Holds the backbone, the expander and the loss; forward returns (loss, stats, embedding)."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.num_features = int(args.mlp.split("-")[-1])
        self.backbone = create_model(args.arch, zero_init_residual=True, num_classes=0)
        self.embedding = self.backbone.num_features
        self.projector = Projector(args, self.embedding)

    def _standardize(self, z):
        return (z - z.mean(0)) / (z.std(0) + 1e-10)  # expect: AMP004, AMP011

    def _barlow(self, z1, z2):
        n = z1.size(0)
        c = self._standardize(z1).T @ self._standardize(z2) / n
        on_diag = torch.diagonal(c).add(-1).pow(2).sum()
        off_diag = off_diagonal(c).pow(2).sum()
        return on_diag + self.args.lambd * off_diag

    def forward(self, x, y):
        emb = self.backbone(x)
        x = self.projector(emb)
        y = self.projector(self.backbone(y))
        stats = {}
        if self.args.loss_type == "barlow":
            return self._barlow(x, y), stats, emb

        repr_loss = F.mse_loss(x, y)

        x = x - x.mean(dim=0)  # expect: AMP004
        y = y - y.mean(dim=0)  # expect: AMP004

        std_x = torch.sqrt(x.var(dim=0) + 0.0001)  # expect: AMP004
        std_y = torch.sqrt(y.var(dim=0) + 0.0001)  # expect: AMP004
        std_loss = torch.mean(F.relu(1 - std_x)) / 2 + torch.mean(F.relu(1 - std_y)) / 2  # expect: AMP004

        cov_x = (x.T @ x) / (self.args.batch_size - 1)
        cov_y = (y.T @ y) / (self.args.batch_size - 1)
        cov_loss = off_diagonal(cov_x).pow_(2).sum().div(self.num_features) + off_diagonal(cov_y).pow_(2).sum().div(
            self.num_features
        )

        loss = self.args.sim_coeff * repr_loss + self.args.std_coeff * std_loss + self.args.cov_coeff * cov_loss
        stats.update(repr=repr_loss.detach(), std=std_loss.detach(), cov=cov_loss.detach())
        stats["emb_norm"] = emb.detach().float().norm(dim=1).mean()
        return loss, stats, emb


def exclude_bias_and_norm(p):
    return p.ndim == 1


def adjust_learning_rate(args, optimizer, loader, step):
    max_steps = args.epochs * len(loader)
    warmup_steps = 10 * len(loader)
    base_lr = args.base_lr * args.batch_size / 256
    if step < warmup_steps:
        lr = base_lr * step / warmup_steps
    else:
        step -= warmup_steps
        max_steps -= warmup_steps
        q = 0.5 * (1 + math.cos(math.pi * step / max_steps))
        lr = base_lr * q + base_lr * 0.001 * (1 - q)
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr


amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)


def main(args, loader):
    model = VICReg(args)
    model.cuda()
    if args.compile:
        model = torch.compile(model)
    probe = nn.Linear(model.embedding, args.num_classes).cuda()
    decay = [p for p in model.parameters() if not exclude_bias_and_norm(p)]
    no_decay = [p for p in model.parameters() if exclude_bias_and_norm(p)]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.wd},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": probe.parameters(), "weight_decay": 0.0, "lr_scale": 10.0},
        ],
        lr=args.base_lr,
    )
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        for step, ((x1, x2), labels) in enumerate(loader, start=epoch * len(loader)):
            x1, x2, labels = x1.cuda(non_blocking=True), x2.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            adjust_learning_rate(args, optimizer, loader, step)
            optimizer.zero_grad(set_to_none=True)
            with amp_autocast():
                loss, stats, emb = model(x1, x2)
                probe_logits = probe(emb.detach())
            probe_loss = F.cross_entropy(probe_logits, labels)  # expect: AMP002
            scaler.scale(loss + probe_loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            if step % args.log_freq == 0:
                acc = (probe_logits.argmax(1) == labels).float().mean()
                print({"step": step, "loss": loss.item(), "probe_acc": acc.item(), **{k: float(v) for k, v in stats.items()}})
    return model


def get_arguments():
    parser = argparse.ArgumentParser("VICReg pretraining")
    parser.add_argument("--arch", default="resnet18", choices=sorted(_model_entrypoints))
    parser.add_argument("--mlp", default="2048-2048-2048")
    parser.add_argument("--loss-type", default="vicreg", choices=["vicreg", "barlow"])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--base-lr", type=float, default=3e-4)
    parser.add_argument("--wd", type=float, default=1e-6)
    parser.add_argument("--clip", type=float, default=3.0)
    parser.add_argument("--sim-coeff", type=float, default=25.0)
    parser.add_argument("--std-coeff", type=float, default=25.0)
    parser.add_argument("--cov-coeff", type=float, default=1.0)
    parser.add_argument("--lambd", type=float, default=5e-3)
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--log-freq", type=int, default=50)
    parser.add_argument("--compile", action="store_true")
    return parser
