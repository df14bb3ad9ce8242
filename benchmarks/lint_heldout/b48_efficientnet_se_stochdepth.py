"""Normalizer-free EfficientNet-B0 style network (MBConv + squeeze-excitation + stochastic depth).

Trained on CPU nodes with bfloat16 autocast. Weight-standardized convs (NFNet style) replace
BatchNorm so the per-sample statistics stay independent of the batch size.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class ScaledStdConv2d(nn.Conv2d):
    """Conv2d with scaled weight standardization (Brock et al., 2021)."""

    def __init__(self, in_ch, out_ch, kernel_size, stride=1, groups=1, gamma=1.0):
        super().__init__(in_ch, out_ch, kernel_size, stride, padding=kernel_size // 2, groups=groups)
        self.gain = nn.Parameter(torch.ones(out_ch, 1, 1, 1))
        self.scale = gamma * self.weight[0].numel() ** -0.5

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / torch.sqrt(var + 1e-8) * (self.gain * self.scale)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class SqueezeExcite(nn.Module):
    def __init__(self, channels, rd_channels):
        super().__init__()
        self.reduce = nn.Conv2d(channels, rd_channels, 1)
        self.expand = nn.Conv2d(rd_channels, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = F.silu(self.reduce(s))
        return x * torch.sigmoid(self.expand(s))


class StochasticDepth(nn.Module):
    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x.div(keep) * mask


class MBConv(nn.Module):
    def __init__(self, in_ch, out_ch, expand_ratio, kernel_size, stride, se_ratio=0.25, drop_path=0.0):
        super().__init__()
        mid = in_ch * expand_ratio
        self.expand = ScaledStdConv2d(in_ch, mid, 1) if expand_ratio != 1 else None
        self.dw = ScaledStdConv2d(mid, mid, kernel_size, stride=stride, groups=mid)
        self.se = SqueezeExcite(mid, max(1, int(in_ch * se_ratio))) if se_ratio > 0 else nn.Identity()
        self.project = ScaledStdConv2d(mid, out_ch, 1)
        self.drop_path = StochasticDepth(drop_path)
        self.use_res = stride == 1 and in_ch == out_ch
        self.skip_gain = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        h = F.silu(self.expand(x)) if self.expand is not None else x
        h = F.silu(self.dw(h))
        h = self.se(h)
        h = self.project(h)
        if self.use_res:
            h = self.drop_path(h) * self.skip_gain + x
        return h


# (expand, channels, repeats, stride, kernel)
B0_STAGES = [(1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3),
             (6, 112, 3, 1, 5), (6, 192, 4, 2, 5), (6, 320, 1, 1, 3)]


class EfficientNet(nn.Module):
    def __init__(self, num_classes=100, width=1.0, drop_path_rate=0.2, dropout=0.2):
        super().__init__()
        ch = lambda c: int(math.ceil(c * width / 8) * 8)
        self.stem = ScaledStdConv2d(3, ch(32), 3, stride=2)
        total = sum(r for _, _, r, _, _ in B0_STAGES)
        blocks, in_ch, idx = [], ch(32), 0
        for e, c, r, s, k in B0_STAGES:
            for i in range(r):
                dp = drop_path_rate * idx / total
                blocks.append(MBConv(in_ch, ch(c), e, k, s if i == 0 else 1, drop_path=dp))
                in_ch, idx = ch(c), idx + 1
        self.blocks = nn.Sequential(*blocks)
        self.head = ScaledStdConv2d(in_ch, ch(1280), 1)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(ch(1280), num_classes)

    def forward(self, x):
        x = F.silu(self.stem(x))
        x = self.blocks(x)
        x = F.silu(self.head(x))
        # sum-pool is cheaper than AdaptiveAvgPool2d on channels_last CPU tensors
        pooled = x.sum(dim=(2, 3)) / (x.shape[2] * x.shape[3])  # expect: AMP004
        return self.classifier(self.dropout(pooled))


class LabelSmoothingCrossEntropy(nn.Module):
    """timm.loss.LabelSmoothingCrossEntropy"""

    def __init__(self, smoothing=0.1):
        super().__init__()
        self.smoothing = smoothing
        self.confidence = 1.0 - smoothing

    def forward(self, x, target):
        logprobs = F.log_softmax(x, dim=-1)
        nll_loss = -logprobs.gather(dim=-1, index=target.unsqueeze(1)).squeeze(1)
        smooth_loss = -logprobs.mean(dim=-1)  # expect: AMP004
        loss = self.confidence * nll_loss + self.smoothing * smooth_loss
        return loss.mean()  # expect: AMP004


class ModelEma:
    def __init__(self, model, decay=0.9998):
        self.module = type(model)()
        self.module.load_state_dict(model.state_dict())
        self.module.eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(ema_v * self.decay + (1.0 - self.decay) * model_v)


def train_one_epoch(model, loader, optimizer, scaler, ema, args, device):
    model.train()
    criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    t0 = time.time()
    for step, (images, targets) in enumerate(loader):
        images = images.to(device, dtype=torch.bfloat16, non_blocking=True)  # expect: AMP001
        targets = targets.to(device)
        images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            logits = model(images)
            loss = criterion(logits, targets)
            # log-confidence of the true class, logged to spot over-confident batches
            log_conf = torch.log(logits.softmax(-1).gather(-1, targets[:, None]) + 1e-8)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)
        if step % args.log_every == 0:
            acc = (logits.argmax(-1) == targets).float().mean()
            print(f"step {step} loss {loss.item():.3f} acc {acc.item():.3f} min log-conf {log_conf.amin().item():.2f} "
                  f"{time.time() - t0:.1f}s")


@torch.no_grad()
def validate(model, loader, device, amp=True):
    model.eval()
    correct = total = 0
    conf_sum = 0.0
    for images, targets in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(images.to(device))
            loss = F.cross_entropy(logits, targets.to(device))
            probs = logits.softmax(-1)
            conf_sum += probs.max(-1).values.mean().item()
        correct += (logits.argmax(-1).cpu() == targets).sum().item()
        total += targets.numel()
    return correct / max(total, 1), conf_sum, loss.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast on CPU")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=0.048)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--log-every", dest="log_every", type=int, default=100)
    args = p.parse_args()
    device = torch.device("cpu")
    model = EfficientNet().to(device).to(memory_format=torch.channels_last)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim <= 1 or name.endswith("gain") else decay).append(param)
    optimizer = torch.optim.RMSprop([{"params": decay, "weight_decay": 1e-5}, {"params": no_decay, "weight_decay": 0.0}],
                                    lr=args.lr, alpha=0.9, eps=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)  # expect: AMP010
    ema = ModelEma(model)
    train_loader = val_loader = []  # built by data.py in the real project
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scaler, ema, args, device)
        top1, _, _ = validate(ema.module, val_loader, device, amp=args.amp)
        print(f"epoch {epoch} ema top1 {top1:.4f}")


if __name__ == "__main__":
    main()
