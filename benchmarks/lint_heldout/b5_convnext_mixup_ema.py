"""ConvNeXt-T ImageNet training with mixup/cutmix, model EMA and fp16 autocast (self.scaler)."""
import copy
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)
        return x.permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, dim, ls_init=1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(ls_init * torch.ones(dim))

    def forward(self, x):
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)
        x = self.pw2(F.gelu(self.pw1(self.norm(x))))
        return shortcut + (self.gamma * x).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims=(96, 192, 384, 768), depths=(3, 3, 9, 3), num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0]))
        stages = []
        for i, (d, n) in enumerate(zip(dims, depths)):
            down = nn.Identity() if i == 0 else nn.Sequential(LayerNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], d, 2, stride=2))
            stages.append(nn.Sequential(down, *[Block(d) for _ in range(n)]))
        self.stages = nn.ModuleList(stages)
        self.proj = nn.Linear(dims[-1], dims[-1])
        self.head_norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], num_classes)

    def forward_features(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.proj(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def forward(self, x):
        return self.head(self.head_norm(self.forward_features(x)))


def mixup_cutmix(x, y, num_classes, alpha=0.8, smoothing=0.1):
    lam = float(np.random.beta(alpha, alpha))
    perm = torch.randperm(x.size(0), device=x.device)
    off = smoothing / num_classes
    y1 = torch.full((y.size(0), num_classes), off, device=x.device).scatter_(1, y[:, None], 1.0 - smoothing + off)
    x = lam * x + (1.0 - lam) * x[perm]
    return x, lam * y1 + (1.0 - lam) * y1[perm]


class ModelEma:
    def __init__(self, model, decay=0.9999):
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)


class Trainer:
    def __init__(self, model: ConvNeXt, lr=4e-3, epochs=300, steps_per_epoch=1251, var_weight=0.01):
        self.model = model.cuda().to(memory_format=torch.channels_last)
        self.ema = ModelEma(self.model)
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            (no_decay if p.ndim <= 1 or n.endswith("gamma") else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, eps=1e-8)
        self.scaler = torch.amp.GradScaler("cuda")
        total = epochs * steps_per_epoch
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
        self.var_weight = var_weight

    def train_one_epoch(self, loader):
        self.model.train()
        for images, labels in loader:
            images = images.cuda(non_blocking=True).half()  # expect: AMP001
            labels = labels.cuda(non_blocking=True)
            images, targets = mixup_cutmix(images, labels, 1000)
            targets = targets.type(torch.cuda.HalfTensor)  # expect: AMP001
            with torch.autocast("cuda", dtype=torch.float16):
                feat = self.model.forward_features(images)
                logits = self.model.head(self.model.head_norm(feat))
                ce = torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
                feat = (feat - feat.mean(0)) / (feat.std(0) + 1e-8)  # expect: AMP004 AMP011
                decor = (feat.T @ feat / feat.size(0)).pow(2).sum() / feat.size(1)
                loss = ce + self.var_weight * decor
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.sched.step()
            self.ema.update(self.model)

    @torch.no_grad()
    def evaluate(self, loader):
        model = self.ema.module
        correct = total = 0
        confidences = []
        for images, labels in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images.cuda().half())
                probs = logits.softmax(dim=-1)
                confidences.append(logits.mean(dim=-1).float())
            correct += (probs.argmax(-1).cpu() == labels).sum().item()
            total += labels.numel()
        return correct / total, torch.cat(confidences).mean().item()

    def save(self, path):
        torch.save({"model": {k: v.half() for k, v in self.ema.module.state_dict().items()},
                    "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict()}, path)


def main(train_loader, val_loader, epochs=300):
    trainer = Trainer(ConvNeXt(), epochs=epochs, steps_per_epoch=len(train_loader))
    best = 0.0
    for epoch in range(epochs):
        trainer.train_one_epoch(train_loader)
        acc, _ = trainer.evaluate(val_loader)
        if acc > best:
            best = acc
            trainer.save("convnext_best.pt")
