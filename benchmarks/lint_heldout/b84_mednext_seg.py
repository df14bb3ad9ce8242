"""3-D MedNeXt-style segmentation network with deep supervision (BraTS / AMOS style volumes)."""
import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data.volumes import PatchDataset, CaseDataset


class LayerNorm3d(nn.Module):
    """channels_first LayerNorm, ConvNeXt style."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None, None] * x + self.bias[:, None, None, None]


class GRN3d(nn.Module):
    """Global response normalisation (ConvNeXt-V2)."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, channels, 1, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1, 1))

    def forward(self, x):
        gx = torch.norm(x, p=2, dim=(2, 3, 4), keepdim=True)
        nx = gx / (gx.mean(dim=1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class MedNeXtBlock(nn.Module):
    def __init__(self, c, expansion=4, kernel=5):
        super().__init__()
        self.dwconv = nn.Conv3d(c, c, kernel, padding=kernel // 2, groups=c)
        self.norm = LayerNorm3d(c)
        self.expand = nn.Conv3d(c, expansion * c, 1)
        self.grn = GRN3d(expansion * c)
        self.project = nn.Conv3d(expansion * c, c, 1)

    def forward(self, x):
        h = self.norm(self.dwconv(x))
        h = self.grn(F.gelu(self.expand(h)))
        return x + self.project(h)


class MedNeXt(nn.Module):
    def __init__(self, in_ch=4, n_classes=4, base=32, depths=(2, 2, 2, 2)):
        super().__init__()
        widths = [base * 2 ** i for i in range(len(depths))]
        self.stem = nn.Conv3d(in_ch, base, 1)
        self.enc = nn.ModuleList([nn.Sequential(*[MedNeXtBlock(w) for _ in range(d)]) for w, d in zip(widths, depths)])
        self.down = nn.ModuleList([nn.Conv3d(widths[i], widths[i + 1], 2, stride=2) for i in range(len(widths) - 1)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2) for i in range(len(widths) - 1)])
        self.dec = nn.ModuleList([nn.Sequential(*[MedNeXtBlock(w) for _ in range(2)]) for w in widths[:-1]])
        self.heads = nn.ModuleList([nn.Conv3d(w, n_classes, 1) for w in widths[:-1]])

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for i, stage in enumerate(self.enc):
            x = stage(x)
            if i < len(self.down):
                skips.append(x)
                x = self.down[i](x)
        outs = []
        for i in reversed(range(len(self.up))):
            x = self.dec[i](self.up[i](x) + skips[i])
            outs.append(self.heads[i](x))
        outs = outs[::-1]
        return outs if self.training else outs[0]


class DiceCELoss(nn.Module):
    def __init__(self, smooth=1e-5, ce_weight=1.0):
        super().__init__()
        self.smooth, self.ce_weight = smooth, ce_weight

    def forward(self, logits, target):
        ce = F.cross_entropy(logits, target)
        probs = torch.softmax(logits, dim=1)
        onehot = F.one_hot(target, logits.shape[1]).permute(0, 4, 1, 2, 3).float()
        dims = (0, 2, 3, 4)
        inter = (probs * onehot).sum(dims)
        denom = probs.sum(dims) + onehot.sum(dims)
        dice = (2 * inter + self.smooth) / (denom + self.smooth)
        return self.ce_weight * ce + (1 - dice[1:].mean())


class DeepSupervisionLoss(nn.Module):
    def __init__(self, loss, n_scales):
        super().__init__()
        w = np.array([1 / 2 ** i for i in range(n_scales)])
        self.weights = (w / w.sum()).tolist()
        self.loss = loss

    def forward(self, outputs, target):
        total = 0.0
        for w, out in zip(self.weights, outputs):
            t = target
            if out.shape[2:] != target.shape[1:]:
                t = F.interpolate(target[:, None].float(), size=out.shape[2:], mode="nearest")[:, 0].long()
            total = total + w * self.loss(out, t)
        return total


def train_epoch(model, loader, criterion, optimizer, scaler, args):
    model.train()
    running = 0.0
    for img, seg in loader:
        img, seg = img.cuda(non_blocking=True), seg.cuda(non_blocking=True).long()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(img)
        loss = criterion(outputs, seg)  # expect: AMP002
        running += loss.item()
        loss = scaler.scale(loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
    return running / len(loader)


def validate(model, loader, n_classes):
    model.eval()
    dices = []
    with torch.no_grad(), torch.cuda.amp.autocast():  # expect: AMP009
        for img, seg in loader:
            logits = model(img.cuda())
            pred = torch.softmax(logits.float(), 1).argmax(1).cpu()
            per_class = []
            for c in range(1, n_classes):
                p, g = (pred == c).float(), (seg == c).float()
                per_class.append(float((2 * (p * g).sum() + 1e-5) / (p.sum() + g.sum() + 1e-5)))
            dices.append(per_class)
    return np.mean(dices, axis=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/brats21_preprocessed")
    ap.add_argument("--n-classes", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--patch", type=int, nargs=3, default=(128, 128, 128))
    ap.add_argument("--out", default="runs/mednext")
    args = ap.parse_args()

    train_loader = DataLoader(PatchDataset(args.data, "train", args.patch), args.batch_size, shuffle=True, num_workers=8)
    val_loader = DataLoader(CaseDataset(args.data, "val"), batch_size=1, num_workers=2)
    model = MedNeXt(n_classes=args.n_classes).cuda()
    criterion = DeepSupervisionLoss(DiceCELoss(), n_scales=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.epochs, power=0.9)
    scaler = torch.amp.GradScaler("cuda")
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        loss = train_epoch(model, train_loader, criterion, optimizer, scaler, args)
        sched.step()
        if epoch % 10 == 0:
            dice = validate(model, val_loader, args.n_classes)
            print(f"epoch {epoch} loss {loss:.4f} dice {np.round(dice, 4).tolist()}")
            torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(args.out, "latest.pt"))


if __name__ == "__main__":
    main()
