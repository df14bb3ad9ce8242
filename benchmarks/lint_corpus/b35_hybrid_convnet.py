"""Hybrid NF-ResNet / ConvNeXt family assembled from a stage spec and block registries.

Each stage is ``StageSpec(kind, depth, width, attn)``; ``build_block`` looks the block
class up in ``BLOCKS`` and the channel-attention layer in ``ATTN_LAYERS``.
"""
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class StageSpec:
    kind: str
    depth: int
    width: int
    attn: Optional[str] = None


DEFAULT_STAGES = (("res", 2, 64, "se"), ("res", 2, 128, "eca"), ("convnext", 6, 256), ("convnext", 2, 512))


@dataclass
class NetConfig:
    stem_width: int = 64
    stages: List[StageSpec] = field(default_factory=lambda: [StageSpec(*s) for s in DEFAULT_STAGES])
    act: str = "GELU"
    num_classes: int = 1000
    drop_path_rate: float = 0.1
    head: str = "attn"


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of an NCHW tensor (original ConvNeXt channels_first form)."""

    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return x * self.weight[:, None, None] + self.bias[:, None, None]


class StdConv2d(nn.Conv2d):
    """Weight-standardised conv (BiT)."""

    def forward(self, x):
        w = self.weight
        v, m = torch.var_mean(w, dim=[1, 2, 3], keepdim=True, unbiased=False)
        w = (w - m) / torch.sqrt(v + 1e-10)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class DropPath(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        mask = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1 - self.p)
        return x * mask / (1 - self.p)


class SqueezeExcite(nn.Module):
    def __init__(self, chs, rd_ratio=0.25):
        super().__init__()
        rd = max(8, int(chs * rd_ratio))
        self.fc1 = nn.Conv2d(chs, rd, 1)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(rd, chs, 1)

    def forward(self, x):
        x_se = x.mean((2, 3), keepdim=True)  # expect: AMP004
        x_se = self.fc2(self.act(self.fc1(x_se)))
        return x * x_se.sigmoid()


class EcaModule(nn.Module):
    """Efficient Channel Attention: a 1-d conv over the pooled channel descriptor."""

    def __init__(self, chs, k_size=3):
        super().__init__()
        self.conv = nn.Conv1d(1, 1, kernel_size=k_size, padding=(k_size - 1) // 2, bias=False)

    def forward(self, x):
        y = x.mean((2, 3)).view(x.shape[0], 1, -1)  # expect: AMP004
        y = self.conv(y)
        return x * y.view(x.shape[0], -1, 1, 1).sigmoid()


ATTN_LAYERS = {"se": SqueezeExcite, "eca": EcaModule}


class ResBlock(nn.Module):
    """Normaliser-free bottleneck (NF-ResNet style): pre-activation, skip-init gain."""

    def __init__(self, in_chs, out_chs, attn=None, act_layer=nn.GELU, drop_path=0.0, alpha=0.2):
        super().__init__()
        mid = out_chs // 4
        self.alpha = alpha
        self.act1 = act_layer()
        self.conv1 = StdConv2d(in_chs, mid, 1)
        self.act2 = act_layer()
        self.conv2 = nn.Conv2d(mid, mid, 3, padding=1, groups=max(1, mid // 16))
        self.act3 = act_layer()
        self.conv3 = nn.Conv2d(mid, out_chs, 1)
        self.attn = ATTN_LAYERS[attn](out_chs) if attn else nn.Identity()
        self.shortcut = nn.Conv2d(in_chs, out_chs, 1) if in_chs != out_chs else nn.Identity()
        self.skipinit_gain = nn.Parameter(torch.zeros(()))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x):
        out = self.act1(x)
        shortcut = self.shortcut(out)
        out = self.conv2(self.act2(self.conv1(out)))
        out = self.attn(self.conv3(self.act3(out)))
        return shortcut + self.drop_path(out * self.skipinit_gain) * self.alpha


class GRN(nn.Module):
    """Global Response Normalisation (ConvNeXt-V2), channels-last input."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.eps = eps

    def forward(self, x):
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + self.eps)
        return self.gamma * (x * nx) + self.beta + x


class ConvNeXtBlock(nn.Module):
    def __init__(self, in_chs, out_chs, attn=None, act_layer=nn.GELU, drop_path=0.0, norm_layer=None):
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        self.conv_dw = nn.Conv2d(in_chs, out_chs, 7, padding=3, groups=in_chs)
        self.norm = norm_layer(out_chs)
        self.pwconv1 = nn.Linear(out_chs, 4 * out_chs)
        self.act = act_layer()
        self.grn = GRN(4 * out_chs)
        self.pwconv2 = nn.Linear(4 * out_chs, out_chs)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.norm(self.conv_dw(x).permute(0, 2, 3, 1))
        x = self.pwconv2(self.grn(self.act(self.pwconv1(x))))
        return shortcut + self.drop_path(x.permute(0, 3, 1, 2))


BLOCKS = {"res": ResBlock, "convnext": ConvNeXtBlock}


def build_block(kind, in_chs, out_chs, **kwargs):
    if kind not in BLOCKS:
        raise KeyError(f"unknown block type {kind!r}; choose from {sorted(BLOCKS)}")
    return BLOCKS[kind](in_chs, out_chs, **kwargs)


class Stage(nn.Module):
    def __init__(self, in_chs, spec: StageSpec, act_layer, drop_rates):
        super().__init__()
        if in_chs != spec.width:
            self.downsample = nn.Sequential(nn.Conv2d(in_chs, spec.width, 2, stride=2), LayerNorm2d(spec.width))
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.ModuleList([
            build_block(spec.kind, spec.width, spec.width, attn=spec.attn, act_layer=act_layer, drop_path=r)
            for r in drop_rates
        ])

    def forward(self, x):
        x = self.downsample(x)
        for blk in self.blocks:
            x = blk(x)
        return x


class AvgPoolHead(nn.Module):
    def __init__(self, in_chs, num_classes):
        super().__init__()
        self.norm = nn.LayerNorm(in_chs, eps=1e-6)
        self.fc = nn.Linear(in_chs, num_classes)

    def forward(self, x, pre_logits=False):
        x = self.norm(F.adaptive_avg_pool2d(x, 1).flatten(1))
        return x if pre_logits else self.fc(x)


class AttnPoolHead(nn.Module):
    """Spatial attention pooling: a 1x1 conv scores every position."""

    def __init__(self, in_chs, num_classes):
        super().__init__()
        self.attn = nn.Conv2d(in_chs, 1, kernel_size=1)
        self.norm = nn.LayerNorm(in_chs, eps=1e-6)
        self.fc = nn.Linear(in_chs, num_classes)

    def forward(self, x, pre_logits=False):
        w = F.relu(self.attn(x)) + 1e-8  # expect: AMP011
        x = (x * w).sum(dim=(2, 3)) / w.sum(dim=(2, 3))
        x = self.norm(x)
        return x if pre_logits else self.fc(x)


class HybridNet(nn.Module):
    def __init__(self, cfg: NetConfig):
        super().__init__()
        act_layer = getattr(nn, cfg.act)
        self.stem = nn.Sequential(nn.Conv2d(3, cfg.stem_width, kernel_size=4, stride=4), LayerNorm2d(cfg.stem_width))
        depths = [s.depth for s in cfg.stages]
        dpr = torch.linspace(0, cfg.drop_path_rate, sum(depths)).split(depths)
        chs, stages = cfg.stem_width, []
        for spec, rates in zip(cfg.stages, dpr):
            stages.append(Stage(chs, spec, act_layer, rates.tolist()))
            chs = spec.width
        self.stages = nn.ModuleList(stages)
        self.head = AttnPoolHead(chs, cfg.num_classes) if cfg.head == "attn" else AvgPoolHead(chs, cfg.num_classes)

    def forward_features(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return x

    def forward_head(self, x, pre_logits=False):
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


MODELS = {
    "hybrid_t": lambda cfg: HybridNet(cfg),
    "hybrid_s": lambda cfg: HybridNet(NetConfig(stem_width=96, act=cfg.act, num_classes=cfg.num_classes, head=cfg.head)),
}


class LabelSmoothingLoss(nn.Module):
    def __init__(self, smoothing=0.1, reduction="mean"):
        super().__init__()
        self.smoothing = smoothing
        self.confidence = 1.0 - smoothing
        self.reduction = reduction

    def forward(self, x, target):
        logprobs = F.log_softmax(x, dim=-1)
        nll = -logprobs.gather(dim=-1, index=target.unsqueeze(1)).squeeze(1)
        smooth = -logprobs.mean(dim=-1)
        loss = self.confidence * nll + self.smoothing * smooth
        if self.reduction == "mean":
            return loss.mean()
        return loss.sum() if self.reduction == "sum" else loss


def train_one_epoch(model, loader, criterion, optimizer, scaler, device, args):
    model.train()
    autocast_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()
    for step, (images, target) in enumerate(loader):
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with autocast_ctx:
            output = model(images)
        loss = criterion(output, target)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip_grad:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip_grad:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
        if step % args.log_interval == 0:
            print(f"step {step}: loss {loss.item():.4f}")


@torch.no_grad()
def evaluate(model, loader, device, amp=True):
    model.eval()
    correct = total = 0
    for images, target in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            output = model(images.to(device, non_blocking=True))
        correct += (output.argmax(-1) == target.to(device)).sum().item()
        total += target.numel()
    return correct / total


def main(args, train_loader, val_loader):
    device = torch.device("cuda")
    cfg = NetConfig(act=args.act, num_classes=args.num_classes, head=args.head)
    model = MODELS[args.arch](cfg)
    model.to(device, memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=args.wd)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None
    criterion = LabelSmoothingLoss(args.smoothing)
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, device, args)
        print(f"epoch {epoch}: top1 {evaluate(model, val_loader, device, amp=args.amp):.4f}")
