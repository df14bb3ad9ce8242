"""3-D residual U-Net with deep supervision for multi-organ CT segmentation.

Loosely follows the nnU-Net recipe: instance norm + leaky ReLU, deep supervision on
the four finest decoder stages, Dice + CE loss, poly learning-rate schedule.
"""
import argparse
import math
import os
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


CFG = {
    "in_channels": 1,
    "num_classes": 4,
    "features": [32, 64, 128, 256, 320],
    "use_se": True,
    "ds_weights": [1.0, 0.5, 0.25, 0.125],
    "smooth": 1e-5,
    "lr": 1e-2,
    "epochs": 300,
    "clip": 12.0,
    "presence_weight": 0.1,
}

UNetOutput = namedtuple("UNetOutput", ["seg", "presence"])


class SqueezeExcite3d(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc1 = nn.Conv3d(channels, max(channels // reduction, 4), 1)
        self.fc2 = nn.Conv3d(max(channels // reduction, 4), channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3, 4), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2 GRN for 3-D feature maps."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, channels, 1, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1, 1))
        self.eps = eps

    def forward(self, x):
        gx = torch.norm(x, p=2, dim=(2, 3, 4), keepdim=True)  # norm: fp32 under CUDA autocast
        nx = gx / (gx.mean(dim=1, keepdim=True) + self.eps)
        return self.gamma * (x * nx) + self.beta + x


class ResidualConvBlock(nn.Module):
    def __init__(self, cin, cout, stride=1, use_se=False):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.InstanceNorm3d(cout, affine=True)
        self.grn = GlobalResponseNorm(cout)
        self.conv2 = nn.Conv3d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.InstanceNorm3d(cout, affine=True)
        self.se = SqueezeExcite3d(cout) if use_se else nn.Identity()
        if cin != cout or stride != 1:
            self.skip = nn.Conv3d(cin, cout, 1, stride, bias=False)
        else:
            self.skip = nn.Identity()

    def forward(self, x):
        h = self.grn(F.leaky_relu(self.norm1(self.conv1(x)), 0.01))
        h = self.se(self.conv2(h))
        return F.leaky_relu(self.norm2(h + self.skip(x)), 0.01)


class AttentionGate(nn.Module):
    """Additive attention gate (Oktay et al.), normalised over the volume."""

    def __init__(self, c_skip, c_gate, c_mid):
        super().__init__()
        self.w_x = nn.Conv3d(c_skip, c_mid, 1)
        self.w_g = nn.Conv3d(c_gate, c_mid, 1)
        self.psi = nn.Conv3d(c_mid, 1, 1)

    def forward(self, skip, gate):
        gate = F.interpolate(gate, size=skip.shape[2:], mode="trilinear", align_corners=False)
        psi = torch.sigmoid(self.psi(F.relu(self.w_x(skip) + self.w_g(gate))))
        # sum runs in fp32 under CUDA autocast, so this epsilon is representable
        alpha = psi / (psi.sum(dim=(2, 3, 4), keepdim=True) + 1e-8)
        return skip * (alpha * psi.shape[2] * psi.shape[3] * psi.shape[4])


class PresenceHead(nn.Module):
    """Predicts which organs appear in the crop (auxiliary multi-label task)."""

    def __init__(self, channels, num_classes):
        super().__init__()
        self.proj = nn.Conv3d(channels, channels, 1)
        self.fc = nn.Linear(channels, num_classes - 1)

    def forward(self, x):
        h = F.relu(self.proj(x))
        pooled = h.mean(dim=(2, 3, 4))  # expect: AMP004
        return self.fc(pooled)


class UNet3d(nn.Module):
    def __init__(self, in_channels, num_classes, features, use_se=True, n_ds=4):
        super().__init__()
        self.encoder = nn.ModuleList()
        c = in_channels
        for i, f in enumerate(features):
            self.encoder.append(ResidualConvBlock(c, f, stride=1 if i == 0 else 2, use_se=use_se))
            c = f
        self.gates = nn.ModuleList()
        self.ups = nn.ModuleList()
        self.decoder = nn.ModuleList()
        self.ds_heads = nn.ModuleList()
        for f_skip in reversed(features[:-1]):
            self.gates.append(AttentionGate(f_skip, c, f_skip // 2))
            self.ups.append(nn.ConvTranspose3d(c, f_skip, 2, 2))
            self.decoder.append(ResidualConvBlock(2 * f_skip, f_skip, use_se=use_se))
            self.ds_heads.append(nn.Conv3d(f_skip, num_classes, 1))
            c = f_skip
        self.presence = PresenceHead(features[-1], num_classes)
        self.n_ds = n_ds

    def forward(self, x):
        skips = []
        for block in self.encoder:
            x = block(x)
            skips.append(x)
        bottleneck = skips.pop()
        presence = self.presence(bottleneck)
        seg = []
        x = bottleneck
        for gate, up, block, head in zip(self.gates, self.ups, self.decoder, self.ds_heads):
            skip = skips.pop()
            x = block(torch.cat([up(x), gate(skip, x)], dim=1))
            seg.append(head(x))
        seg = seg[::-1][: self.n_ds]  # finest first
        if not self.training:
            return UNetOutput(seg[0], presence)
        return UNetOutput(seg, presence)


def build_unet(cfg):
    return UNet3d(cfg["in_channels"], cfg["num_classes"], cfg["features"], use_se=cfg["use_se"])


class SoftDiceLoss(nn.Module):
    def __init__(self, smooth=1e-5, do_bg=False):
        super().__init__()
        self.smooth = smooth
        self.do_bg = do_bg

    def forward(self, logits, target_onehot):
        probs = torch.softmax(logits, dim=1)  # fp32 under CUDA autocast
        if not self.do_bg:
            probs, target_onehot = probs[:, 1:], target_onehot[:, 1:]
        axes = tuple(range(2, probs.ndim))
        inter = (probs * target_onehot).sum(axes)
        card = probs.sum(axes) + target_onehot.sum(axes)
        dice = (2.0 * inter + self.smooth) / (card + self.smooth)
        return 1.0 - dice.mean()


def presence_focal_loss(logits, present, gamma=2.0):
    p = torch.sigmoid(logits)
    pos = present * (1.0 - p).pow(gamma) * torch.log(p + 1e-8)  # expect: AMP011
    neg = (1.0 - present) * p.pow(gamma) * torch.log(1.0 - p + 1e-8)  # expect: AMP011
    return -(pos + neg).mean()


class DeepSupervisionDiceCE(nn.Module):
    def __init__(self, num_classes, weights, smooth):
        super().__init__()
        self.num_classes = num_classes
        w = np.array(weights, dtype=np.float64)
        self.weights = (w / w.sum()).tolist()
        self.dice = SoftDiceLoss(smooth=smooth)

    def forward(self, seg_outputs, target):
        total = 0.0
        for w, logits in zip(self.weights, seg_outputs):
            t = F.interpolate(target[:, None].float(), size=logits.shape[2:], mode="nearest")[:, 0].long()
            onehot = F.one_hot(t, self.num_classes).permute(0, 4, 1, 2, 3).float()
            total = total + w * (F.cross_entropy(logits, t) + self.dice(logits, onehot))
        return total


class CTPatchDataset(Dataset):
    def __init__(self, root, patch=(96, 160, 160), num_classes=4):
        self.files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".npz"))
        self.patch = patch
        self.num_classes = num_classes

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        img, seg = d["image"].astype(np.float32), d["label"].astype(np.int64)
        img = (img - img.mean()) / (img.std() + 1e-8)  # numpy fp32
        present = np.array([(seg == c).any() for c in range(1, self.num_classes)], dtype=np.float32)
        return torch.from_numpy(img)[None], torch.from_numpy(seg), torch.from_numpy(present)


def poly_lr(epoch, max_epochs, base_lr, exponent=0.9):
    return base_lr * (1 - epoch / max_epochs) ** exponent


def train_one_epoch(model, loader, criterion, optimizer, scaler, device, cfg):
    model.train()
    running = 0.0
    for it, (img, seg, present) in enumerate(loader):
        img, seg, present = img.to(device), seg.to(device), present.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(img)
            loss = criterion(out.seg, seg)
            loss = loss + cfg["presence_weight"] * presence_focal_loss(out.presence, present)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        running += loss.item()
    return running / max(len(loader), 1)


@torch.no_grad()
def validate(model, loader, device, num_classes):
    model.eval()
    dices = []
    for img, seg, _ in loader:
        img, seg = img.to(device), seg.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(img).seg
        pred = logits.argmax(1)
        per_class = []
        for c in range(1, num_classes):
            p, t = (pred == c).float(), (seg == c).float()
            per_class.append((2 * (p * t).sum() / (p.sum() + t.sum() + 1e-8)).item())
        dices.append(per_class)
    return np.mean(np.array(dices), axis=0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/ct")
    parser.add_argument("--out", default="runs/unet")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_unet(CFG).to(device)
    criterion = DeepSupervisionDiceCE(CFG["num_classes"], CFG["ds_weights"], CFG["smooth"])
    optimizer = torch.optim.SGD(model.parameters(), lr=CFG["lr"], momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    train_loader = DataLoader(CTPatchDataset(os.path.join(args.data, "train")), batch_size=2, shuffle=True, num_workers=8)
    val_loader = DataLoader(CTPatchDataset(os.path.join(args.data, "val")), batch_size=1)
    best = -math.inf
    for epoch in range(CFG["epochs"]):
        for g in optimizer.param_groups:
            g["lr"] = poly_lr(epoch, CFG["epochs"], CFG["lr"])
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, scaler, device, CFG)
        if epoch % 10 == 0:
            dice = validate(model, val_loader, device, CFG["num_classes"])
            print(f"epoch {epoch} loss {train_loss:.4f} dice {dice}")
            if dice.mean() > best:
                best = float(dice.mean())
                torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
