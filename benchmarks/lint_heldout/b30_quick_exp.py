"""Quick experiment: spiking CNN on event-camera voxel grids (DVS128 Gesture).

    python b30_quick_exp.py --data /data/dvs_gesture --amp --epochs 40
    python b30_quick_exp.py --data /data/dvs_gesture --amp --bf16 --clip 1.0
    python b30_quick_exp.py --data /data/dvs_gesture --fp16-weights
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--time-bins", type=int, default=16)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--amp", action="store_true", help="autocast forward pass")
    p.add_argument("--bf16", action="store_true", help="use bfloat16 for autocast")
    p.add_argument("--fp16-weights", action="store_true", help="store model weights in float16")
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/snn_gesture")
    return p.parse_args()


def events_to_voxel(events, num_bins, height, width):
    """events: (N, 4) array of x, y, t, p with p in {0, 1}."""
    voxel = np.zeros((num_bins, 2, height, width), dtype=np.float32)
    if len(events) == 0:
        return voxel
    t = events[:, 2].astype(np.float64)
    t = (t - t[0]) / max(t[-1] - t[0], 1e-9) * (num_bins - 1)
    bins = np.clip(t.astype(np.int64), 0, num_bins - 1)
    x = events[:, 0].astype(np.int64)
    y = events[:, 1].astype(np.int64)
    pol = events[:, 3].astype(np.int64)
    np.add.at(voxel, (bins, pol, y, x), 1.0)
    return np.log1p(voxel)


class EventDataset(Dataset):
    def __init__(self, root, split, num_bins, size):
        self.files = sorted(glob.glob(os.path.join(root, split, "*", "*.npy")))
        self.classes = sorted({os.path.basename(os.path.dirname(f)) for f in self.files})
        self.num_classes = len(self.classes)
        self.num_bins, self.size = num_bins, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        voxel = events_to_voxel(np.load(path), self.num_bins, self.size, self.size)
        label = self.classes.index(os.path.basename(os.path.dirname(path)))
        return torch.from_numpy(voxel), label


class SpikeFn(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, v, alpha):
        ctx.save_for_backward(v)
        ctx.alpha = alpha
        return (v > 0).to(v.dtype)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        (v,) = ctx.saved_tensors
        sg = torch.sigmoid(ctx.alpha * v)
        return grad_out * ctx.alpha * sg * (1 - sg), None


class LIF(nn.Module):
    def __init__(self, tau=2.0, v_th=1.0, alpha=4.0):
        super().__init__()
        self.tau, self.v_th, self.alpha = tau, v_th, alpha

    def forward(self, x):
        mem = torch.zeros_like(x[0])
        spikes = []
        for t in range(x.size(0)):
            mem = mem + (x[t] - mem) / self.tau
            s = SpikeFn.apply(mem - self.v_th, self.alpha)
            mem = mem * (1.0 - s)
            spikes.append(s)
        return torch.stack(spikes)


class TdBatchNorm(nn.Module):
    """Threshold-dependent batch norm: statistics over time, batch and space."""

    def __init__(self, channels, v_th=1.0, alpha=1.0, eps=1e-5, momentum=0.1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.v_th, self.alpha, self.eps, self.momentum = v_th, alpha, eps, momentum

    def forward(self, y):
        if self.training:
            mean = y.mean(dim=(0, 1, 3, 4), keepdim=True)  # expect: AMP004
            var = y.float().var(dim=(0, 1, 3, 4), keepdim=True, unbiased=False)
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.flatten().float())
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var.flatten())
        else:
            mean = self.running_mean.view(1, 1, -1, 1, 1)
            var = self.running_var.view(1, 1, -1, 1, 1)
        y_hat = (y - mean) / torch.sqrt(var + self.eps)
        w = self.weight.view(1, 1, -1, 1, 1)
        b = self.bias.view(1, 1, -1, 1, 1)
        return self.alpha * self.v_th * y_hat * w + b


class SpikingBlock(nn.Module):
    def __init__(self, cin, cout, pool=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.norm = TdBatchNorm(cout)
        self.lif = LIF()
        self.pool = nn.AvgPool2d(2) if pool else nn.Identity()

    def forward(self, x):
        t, b = x.shape[:2]
        y = self.conv(x.flatten(0, 1)).unflatten(0, (t, b))
        s = self.lif(self.norm(y))
        return self.pool(s.flatten(0, 1)).unflatten(0, (t, b))


class SpikingConvNet(nn.Module):
    def __init__(self, num_classes, in_ch=2, widths=(32, 64, 128, 128, 256)):
        super().__init__()
        blocks, c = [], in_ch
        for i, w in enumerate(widths):
            blocks.append(SpikingBlock(c, w, pool=i > 0))
            c = w
        self.features = nn.ModuleList(blocks)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = x.transpose(0, 1)
        for blk in self.features:
            x = blk(x)
        feat = x.flatten(3).sum(-1) / x[0, 0, 0].numel()
        rates = feat.sum(0) / x.size(0)
        return self.fc(rates)


def prepare(batch, device):
    voxels, labels = batch
    voxels = voxels.to(device, non_blocking=True).half()  # expect: AMP001
    return voxels, labels.to(device, non_blocking=True)


def train_one_epoch(model, loader, optimizer, scaler, args, device, amp_dtype):
    model.train()
    total, correct, loss_sum = 0, 0, 0.0
    for batch in loader:
        voxels, labels = prepare(batch, device)
        with torch.autocast("cuda", dtype=amp_dtype, enabled=args.amp):
            logits = model(voxels)
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.item() * labels.size(0)
        correct += (logits.argmax(1) == labels).sum().item()
        total += labels.size(0)
    return loss_sum / max(total, 1), correct / max(total, 1)


@torch.no_grad()
def evaluate(model, loader, device, args, amp_dtype):
    model.eval()
    correct = total = 0
    for voxels, labels in loader:
        voxels = voxels.to(device, non_blocking=True)
        if args.fp16_weights:
            voxels = voxels.half()
        with torch.autocast("cuda", dtype=amp_dtype, enabled=args.amp):
            logits = model(voxels)
        correct += (logits.argmax(1) == labels.to(device)).sum().item()
        total += labels.numel()
    return correct / max(total, 1)


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device("cuda")
    amp_dtype = torch.bfloat16 if args.bf16 else torch.float16

    train_set = EventDataset(args.data, "train", args.time_bins, args.size)
    val_set = EventDataset(args.data, "test", args.time_bins, args.size)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=4)

    model = SpikingConvNet(num_classes=train_set.num_classes).to(device)
    if args.fp16_weights:
        model = model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    if args.compile:
        model = torch.compile(model)
    scaler = torch.amp.GradScaler("cuda") if (args.amp and not args.bf16) else None

    os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        train_loss, train_acc = train_one_epoch(model, train_loader, optimizer, scaler, args, device, amp_dtype)
        val_acc = evaluate(model, val_loader, device, args, amp_dtype)
        scheduler.step()
        print(f"epoch {epoch:3d} loss {train_loss:.4f} train {train_acc:.3f} val {val_acc:.3f} "
              f"({time.time() - t0:.1f}s)")
        if val_acc > best_acc:
            best_acc = val_acc
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
    print(f"best val acc {best_acc:.4f}")


if __name__ == "__main__":
    main()
