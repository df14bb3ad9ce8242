"""ImageNet-100 classifier in plain PyTorch: gradient accumulation, AMP with a
GradScaler, an EMA of the weights, an LR warm-up phase and a linear-probe
fine-tuning utility."""
import argparse
import copy
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in, width, stride=1):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.down is None else self.down(x)
        return F.relu(out + identity)


class Net(nn.Module):
    def __init__(self, num_classes=100, layers=(2, 3, 4, 2)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        blocks, c = [], 64
        for i, n in enumerate(layers):
            width = 64 * 2 ** i
            for j in range(n):
                blocks.append(Bottleneck(c, width, stride=2 if (j == 0 and i > 0) else 1))
                c = width * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.dim = c
        self.fc = nn.Linear(c, num_classes)

    def features(self, x):
        return F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1)

    def forward(self, x):
        return self.fc(self.features(x))


class ModelEma:
    def __init__(self, model, decay=0.9998):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.dtype.is_floating_point:
                ema_v.mul_(self.decay).add_(model_v.detach(), alpha=1.0 - self.decay)
            else:
                ema_v.copy_(model_v)


def backward_micro(loss, scaler, accum_steps):
    scaler.scale(loss / accum_steps).backward()  # expect: AMP008


def warmup_epoch(model, loader, optimizer, base_lr, device="cuda"):
    """One epoch of linear LR warm-up before the main schedule starts."""
    model.train()
    n = len(loader)
    for i, (images, targets) in enumerate(loader):
        for g in optimizer.param_groups:
            g["lr"] = base_lr * (i + 1) / n
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            loss = F.cross_entropy(model(images), targets, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_one_epoch(model, ema, loader, optimizer, scaler, accum_steps, clip, device="cuda"):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    running, seen = 0.0, 0
    for it, (images, targets) in enumerate(loader):
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
            loss = F.cross_entropy(logits, targets, label_smoothing=0.1)
            backward_micro(loss, scaler, accum_steps)
        running += loss.item() * images.size(0)
        seen += images.size(0)
        if (it + 1) % accum_steps == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
            ema.update(model)
    return running / max(seen, 1)


@torch.no_grad()
def evaluate(model, loader, device="cuda"):
    model.eval()
    correct, total = 0, 0
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images.to(device))
        correct += (logits.float().argmax(dim=1) == targets.to(device)).sum().item()
        total += targets.numel()
    return correct / max(total, 1)


def finetune_probe(backbone, loader, num_classes, epochs=5, device="cuda"):
    """Linear probe on frozen backbone features."""
    backbone.eval().requires_grad_(False)
    probe = nn.Linear(backbone.dim, num_classes).to(device).half()  # expect: AMP001
    opt = torch.optim.Adam(probe.parameters(), lr=1e-3)  # expect: AMP011
    for _ in range(epochs):
        for images, targets in loader:
            with torch.no_grad():
                feats = backbone.features(images.to(device)).half()
            loss = F.cross_entropy(probe(feats).float(), targets.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return probe


def save_checkpoint(model, ema, optimizer, epoch, path):
    torch.save(
        {
            "epoch": epoch,
            "model": model.state_dict(),
            "ema_fp16": {k: v.half() if v.is_floating_point() else v for k, v in ema.module.state_dict().items()},
            "optimizer": optimizer.state_dict(),
        },
        path,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="imagenet100.pt")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--lr", type=float, default=0.4)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--out", default="runs/accum_ema")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    model = Net().cuda()
    ema = ModelEma(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-5)
    scaler = torch.amp.GradScaler("cuda")
    data = torch.load(args.data)
    train_loader, val_loader = data["train"], data["val"]

    warmup_epoch(model, train_loader, optimizer, args.lr)
    best_acc = -1e9
    for epoch in range(1, args.epochs):
        for g in optimizer.param_groups:
            g["lr"] = 0.5 * args.lr * (1 + math.cos(math.pi * epoch / args.epochs))
        train_loss = train_one_epoch(model, ema, train_loader, optimizer, scaler, args.accum_steps, args.clip)
        acc = evaluate(ema.module, val_loader)
        print(f"epoch {epoch} loss {train_loss:.4f} ema acc {acc:.4f}")
        if acc > best_acc:
            best_acc = acc
            save_checkpoint(model, ema, optimizer, epoch, os.path.join(args.out, "best.pt"))

    probe = finetune_probe(ema.module, train_loader, 100)
    torch.save(probe.state_dict(), os.path.join(args.out, "probe.pt"))


if __name__ == "__main__":
    main()
