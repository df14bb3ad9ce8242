"""Image classifier training with EMA weights, mixup and compact fp16 checkpoints."""
import copy
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNetTiny(nn.Module):
    def __init__(self, num_classes=100, widths=(64, 128, 256, 512)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, stride=1 if i == 0 else 2))
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward_features(self, x):
        return torch.flatten(self.pool(self.blocks(self.stem(x))), 1)

    def forward(self, x):
        return self.fc(self.forward_features(x))


class ModelEma:
    def __init__(self, model, decay=0.9998):
        self.ema = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach().to(v.dtype), alpha=1 - self.decay)


def make_scaler(enabled=True):
    """GradScaler for old and new releases (falls back to torch.cuda.amp.GradScaler before torch.amp)."""
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def accuracy(output, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.reshape(1, -1).expand_as(pred.t()))
    return [correct[:k].reshape(-1).float().sum(0) * 100.0 / target.size(0) for k in topk]


def clip_gradients(model, max_norm):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def train_one_epoch(model, loader, criterion, optimizer, scaler, ema, device, class_mask=None, clip_grad=None):
    model.train()
    for it, (images, target) in enumerate(loader):
        images = images.cuda(non_blocking=True).type(torch.cuda.HalfTensor)  # expect: AMP001
        target = target.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            if class_mask is not None:
                output = output.masked_fill(~class_mask, -1e9)  # expect: AMP007
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if clip_grad is not None:
            scaler.unscale_(optimizer)
            clip_gradients(model, clip_grad)
        scaler.step(optimizer)
        scaler.update()
        ema.update(model)
        if it % 50 == 0:
            acc1, acc5 = accuracy(output, target)
            print(f"it {it} loss {loss.item():.3f} acc@1 {acc1.item():.1f} acc@5 {acc5.item():.1f}")


def train_mixup_epoch(model, loader, optimizer, scaler, device, accum_steps=2, max_norm=5.0, alpha=0.2):
    model.train()
    for i, (images, target) in enumerate(loader):
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        lam = float(np.random.beta(alpha, alpha))
        perm = torch.randperm(images.size(0), device=device)
        mixed = lam * images + (1 - lam) * images[perm]
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(mixed)
            loss = lam * F.cross_entropy(output, target) + (1 - lam) * F.cross_entropy(output, target[perm])
        scaler.scale(loss / accum_steps).backward()
        if (i + 1) % accum_steps == 0:
            clip_gradients(model, max_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def train_linear_probe(backbone, head, loader, device, epochs=10):
    backbone = backbone.half().eval()
    backbone.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    for _ in range(epochs):
        for images, target in loader:
            images, target = images.to(device), target.to(device)
            with torch.no_grad():
                feats = backbone.forward_features(images.half()).float()
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(head(feats), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def save_checkpoint(model, ema, optimizer, epoch, path):
    ckpt = {
        "epoch": epoch,
        "model": model.state_dict(),
        "ema": copy.deepcopy(ema.ema).half(),
        "optimizer": optimizer.state_dict(),
    }
    torch.save(ckpt, path)


def convert_checkpoint_to_half(src, dst):
    state = torch.load(src, map_location="cpu")
    sd = state["model"] if "model" in state else state
    half_sd = OrderedDict((k, v.half() if v.is_floating_point() else v) for k, v in sd.items())
    torch.save(half_sd, dst)


def dump_features(model, loader, path, device):
    model.eval()
    chunks = []
    with torch.no_grad():
        for images, _ in loader:
            chunks.append(model.forward_features(images.to(device)).cpu().numpy().astype(np.float16))
    np.save(path, np.concatenate(chunks))


def main(epochs=90, out_dir="checkpoints"):
    device = torch.device("cuda")
    data = TensorDataset(torch.randn(2048, 3, 32, 32), torch.randint(0, 100, (2048,)))
    loader = DataLoader(data, batch_size=256, shuffle=True, drop_last=True, pin_memory=True)
    model = ResNetTiny(num_classes=100).to(device).to(memory_format=torch.channels_last)
    ema = ModelEma(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    os.makedirs(out_dir, exist_ok=True)
    for epoch in range(epochs):
        if epoch < epochs - 10:
            train_one_epoch(model, loader, criterion, optimizer, scaler, ema, device, clip_grad=1.0)
        else:
            train_mixup_epoch(model, loader, optimizer, scaler, device)
        save_checkpoint(model, ema, optimizer, epoch, os.path.join(out_dir, "last.pt"))
    convert_checkpoint_to_half(os.path.join(out_dir, "last.pt"), os.path.join(out_dir, "last_fp16.pt"))
    probe = nn.Linear(512, 100).to(device)
    train_linear_probe(copy.deepcopy(ema.ema), probe, loader, device)
    dump_features(ema.ema, loader, os.path.join(out_dir, "features.npy"), device)


if __name__ == "__main__":
    main()
