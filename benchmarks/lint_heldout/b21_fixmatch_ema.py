"""FixMatch on CIFAR-10 with 250 labels, WRN-28-2, EMA teacher for evaluation.

Weak/strong views come from the loader as normalised float tensors; the
pseudo-label of the weak view is kept when its confidence passes the
threshold. Logits of the weak view are centred with a running mean
(debiased pseudo-labelling) before thresholding.
"""
import argparse
import copy
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T


@dataclass
class FMConfig:
    data: str = "/data/cifar10"
    num_labels: int = 250
    num_classes: int = 10
    batch_size: int = 64
    mu: int = 7
    lr: float = 0.03
    wd: float = 5e-4
    total_steps: int = 2 ** 20
    threshold: float = 0.95
    lambda_u: float = 1.0
    T: float = 1.0
    ema_decay: float = 0.999
    center_m: float = 0.999
    debias_tau: float = 0.5
    grad_clip: float = 5.0
    warmup_steps: int = 500
    eval_every: int = 1024
    amp: bool = True
    out: str = "runs/fixmatch"


def conv_bn(c_in, c_out, stride):
    return nn.Sequential(nn.BatchNorm2d(c_in, momentum=0.001), nn.LeakyReLU(0.1, inplace=True),
                         nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False))


class WideBasic(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.block1 = conv_bn(c_in, c_out, stride)
        self.block2 = conv_bn(c_out, c_out, 1)
        self.shortcut = None if c_in == c_out and stride == 1 else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        out = self.block2(self.block1(x))
        return out + (x if self.shortcut is None else self.shortcut(x))


class WideResNet(nn.Module):
    def __init__(self, num_classes, depth=28, widen=2):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers = []
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(WideBasic(widths[i] if j == 0 else widths[i + 1], widths[i + 1], stride if j == 0 else 1))
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(widths[-1], momentum=0.001)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        out = F.leaky_relu(self.bn(self.blocks(self.conv1(x))), 0.1)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


class ModelEMA:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
            else:
                e.copy_(p)


def cosine_lr(optimizer, base_lr, total):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: math.cos(7 * math.pi * s / (16 * total)))


def warmup_supervised(model, loader, optimizer, scaler, amp_autocast, steps, device):
    """A few hundred supervised steps so the first pseudo-labels are not noise."""
    model.train()
    it = iter(loader)
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x, y = x.to(device), y.to(device)
        with amp_autocast():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(model, loader, device, amp_autocast):
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with amp_autocast():
            logits = model(x)
        correct += (logits.argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total


def train_fixmatch(cfg: FMConfig, labeled_loader, unlabeled_loader, test_loader):
    device = torch.device("cuda")
    model = WideResNet(cfg.num_classes).to(device).to(memory_format=torch.channels_last)
    ema = ModelEMA(model, cfg.ema_decay)
    no_decay = ["bias", "bn"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": cfg.wd},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True)
    scheduler = cosine_lr(optimizer, cfg.lr, cfg.total_steps)
    amp_autocast = functools.partial(torch.cuda.amp.autocast, enabled=cfg.amp, dtype=torch.float16)  # expect: AMP009
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
    warmup_supervised(model, labeled_loader, optimizer, scaler, amp_autocast, cfg.warmup_steps, device)

    logit_center = torch.zeros(cfg.num_classes, device=device)
    lab_iter, unl_iter = iter(labeled_loader), iter(unlabeled_loader)
    best_acc = 0.0
    for step in range(cfg.total_steps):
        try:
            x_l, y_l = next(lab_iter)
        except StopIteration:
            lab_iter = iter(labeled_loader)
            x_l, y_l = next(lab_iter)
        try:
            (u_w, u_s), _ = next(unl_iter)
        except StopIteration:
            unl_iter = iter(unlabeled_loader)
            (u_w, u_s), _ = next(unl_iter)
        bs = x_l.size(0)
        x_l, y_l = x_l.to(device, non_blocking=True), y_l.to(device, non_blocking=True)
        # unlabeled views are 7x the labeled batch: ship them as half to cut H2D traffic
        u_w, u_s = (t.to(device, dtype=torch.float16, non_blocking=True) for t in (u_w, u_s))  # expect: AMP001
        model.train()
        with amp_autocast():
            inputs = torch.cat([x_l, u_w, u_s]).contiguous(memory_format=torch.channels_last)
            logits = model(inputs)
            logits_x = logits[:bs]
            logits_w, logits_s = logits[bs:].chunk(2)
            loss_x = F.cross_entropy(logits_x, y_l)
            with torch.no_grad():
                logit_center.mul_(cfg.center_m).add_(logits_w.detach().mean(dim=0), alpha=1 - cfg.center_m)  # expect: AMP004
                adjusted = logits_w.detach().float() - cfg.debias_tau * logit_center
                probs = torch.softmax(adjusted / cfg.T, dim=-1)
                max_p, pseudo = probs.max(dim=-1)
                mask = max_p.ge(cfg.threshold).float()
            loss_u = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
            loss = loss_x + cfg.lambda_u * loss_u
        scaler.scale(loss).backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)

        if step % 64 == 0:
            print(f"step {step} lx {loss_x.item():.4f} lu {loss_u.item():.4f} mask {mask.mean().item():.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.4f}")
        if (step + 1) % cfg.eval_every == 0:
            acc = evaluate(ema.module, test_loader, device, amp_autocast)
            print(f"step {step + 1} ema top1 {acc:.4f}")
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(), "step": step},
                           os.path.join(cfg.out, "best.pt"))
    return best_acc


class TwoViews:
    def __init__(self, weak, strong):
        self.weak, self.strong = weak, strong

    def __call__(self, img):
        return self.weak(img), self.strong(img)


def build_loaders(cfg: FMConfig):
    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616))
    weak = T.Compose([T.RandomHorizontalFlip(), T.RandomCrop(32, 4, padding_mode="reflect"), T.ToTensor(), norm])
    strong = T.Compose([T.RandomHorizontalFlip(), T.RandomCrop(32, 4, padding_mode="reflect"),
                        T.RandAugment(2, 10), T.ToTensor(), norm, T.RandomErasing(p=1.0, scale=(0.02, 0.15))])
    base = datasets.CIFAR10(cfg.data, train=True, download=False)
    per_class = cfg.num_labels // cfg.num_classes
    idx = [i for c in range(cfg.num_classes) for i in [j for j, t in enumerate(base.targets) if t == c][:per_class]]
    labeled = torch.utils.data.Subset(datasets.CIFAR10(cfg.data, train=True, transform=weak), idx)
    unlabeled = datasets.CIFAR10(cfg.data, train=True, transform=TwoViews(weak, strong))
    test = datasets.CIFAR10(cfg.data, train=False, transform=T.Compose([T.ToTensor(), norm]))
    sampler = torch.utils.data.RandomSampler(labeled, replacement=True, num_samples=cfg.batch_size * 1024)
    return (DataLoader(labeled, batch_size=cfg.batch_size, sampler=sampler, num_workers=4, drop_last=True),
            DataLoader(unlabeled, batch_size=cfg.batch_size * cfg.mu, shuffle=True, num_workers=8, drop_last=True),
            DataLoader(test, batch_size=512, num_workers=4))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=FMConfig.data)
    ap.add_argument("--num-labels", type=int, default=250)
    ap.add_argument("--no-amp", action="store_true")
    a = ap.parse_args()
    cfg = FMConfig(data=a.data, num_labels=a.num_labels, amp=not a.no_amp)
    os.makedirs(cfg.out, exist_ok=True)
    print("best EMA accuracy", train_fixmatch(cfg, *build_loaders(cfg)))
