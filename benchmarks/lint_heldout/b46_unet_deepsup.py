"""2D U-Net (nnU-Net flavoured) for multi-organ CT: deep supervision, attention-gated skips,
entropy refinement; norm/non-linearity looked up by name. fp16 autocast + GradScaler, optional DDP."""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

PLANS = {
    "2d_instnorm": {"features": (32, 64, 128, 256, 320), "n_convs": 2, "norm_op": "InstanceNorm2d",
                    "norm_kwargs": {"eps": 1e-5, "affine": True}, "nonlin": "LeakyReLU",
                    "nonlin_kwargs": {"negative_slope": 1e-2, "inplace": True}, "use_se": True},
    "2d_batchnorm": {"features": (32, 64, 128, 256), "n_convs": 2, "norm_op": "BatchNorm2d", "norm_kwargs": {},
                     "nonlin": "ReLU", "nonlin_kwargs": {"inplace": True}, "use_se": False},
}


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class ConvNormAct(nn.Module):
    def __init__(self, in_ch, out_ch, plans, stride=1, use_se=False):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.se = SqueezeExcite(out_ch) if use_se else nn.Identity()
        self.norm = getattr(nn, plans["norm_op"])(out_ch, **plans["norm_kwargs"])
        self.act = getattr(nn, plans["nonlin"])(**plans["nonlin_kwargs"])

    def forward(self, x):
        return self.act(self.norm(self.se(self.conv(x))))


class EncoderStage(nn.Module):
    def __init__(self, in_ch, out_ch, n_convs, plans, stride):
        super().__init__()
        self.blocks = nn.Sequential(
            ConvNormAct(in_ch, out_ch, plans, stride=stride, use_se=plans["use_se"]),
            *[ConvNormAct(out_ch, out_ch, plans, use_se=plans["use_se"]) for _ in range(n_convs - 1)],
        )

    def forward(self, x):
        return self.blocks(x)


class AttentionGate(nn.Module):
    """Additive attention on a skip connection; coefficients are normalised to unit spatial mean."""
    def __init__(self, g_ch, x_ch, inter_ch):
        super().__init__()
        self.w_g = nn.Conv2d(g_ch, inter_ch, 1)
        self.w_x = nn.Conv2d(x_ch, inter_ch, 1)
        self.psi = nn.Conv2d(inter_ch, 1, 1)

    def forward(self, g, x):
        alpha = torch.sigmoid(self.psi(F.relu(self.w_g(g) + self.w_x(x))))
        alpha = alpha / (alpha.mean(dim=(2, 3), keepdim=True) + 1e-8)  # expect: AMP004, AMP011
        return x * alpha


class DecoderStage(nn.Module):
    def __init__(self, in_ch, skip_ch, out_ch, plans):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, skip_ch, 2, stride=2)
        self.att = AttentionGate(skip_ch, skip_ch, max(skip_ch // 2, 8))
        self.convs = nn.Sequential(ConvNormAct(2 * skip_ch, out_ch, plans), ConvNormAct(out_ch, out_ch, plans))

    def forward(self, x, skip):
        up = self.up(x)
        return self.convs(torch.cat([up, self.att(up, skip)], dim=1))


class UncertaintyRefine(nn.Module):
    """Feeds the (upsampled) entropy of the coarse prediction back into the finest features."""
    def __init__(self, channels):
        super().__init__()
        self.mix = nn.Conv2d(channels + 1, channels, 3, padding=1)

    def forward(self, feat, coarse_logits):
        p = torch.sigmoid(coarse_logits)
        entropy = -(p * torch.log(p + 1e-8)).sum(1, keepdim=True)  # expect: AMP011
        entropy = F.interpolate(entropy, size=feat.shape[-2:], mode="bilinear", align_corners=False)
        return self.mix(torch.cat([feat, entropy], dim=1))


class UNet(nn.Module):
    def __init__(self, plans, in_channels, num_classes, deep_supervision=True):
        super().__init__()
        f = plans["features"]
        self.encoder = nn.ModuleList([
            EncoderStage(in_channels if i == 0 else f[i - 1], f[i], plans["n_convs"], plans, 1 if i == 0 else 2)
            for i in range(len(f))
        ])
        self.decoder = nn.ModuleList([DecoderStage(f[i + 1], f[i], f[i], plans) for i in reversed(range(len(f) - 1))])
        self.seg_heads = nn.ModuleList([nn.Conv2d(f[i], num_classes, 1) for i in reversed(range(len(f) - 1))])
        self.coarse_head = nn.Conv2d(f[-1], num_classes, 1)
        self.refine = UncertaintyRefine(f[0])
        self.deep_supervision = deep_supervision

    def forward(self, x):
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        coarse = self.coarse_head(x)
        outputs = []
        for i, dec in enumerate(self.decoder):
            x = dec(x, skips.pop())
            if i == len(self.decoder) - 1:
                x = self.refine(x, coarse)
            outputs.append(self.seg_heads[i](x))
        if self.deep_supervision and self.training:
            return outputs[::-1]
        return outputs[-1]


class DiceBCELoss(nn.Module):
    def __init__(self, smooth=1e-5):
        super().__init__()
        self.smooth = smooth
        self.bce = nn.BCEWithLogitsLoss()

    def forward(self, logits, target):
        probs, axes = torch.sigmoid(logits), (0, 2, 3)
        intersect = (probs * target).sum(axes)
        denom = probs.sum(axes) + target.sum(axes)
        dice = (2 * intersect + self.smooth) / (denom + self.smooth)
        return self.bce(logits, target) + (1 - dice.mean())


class DeepSupervisionLoss(nn.Module):
    def __init__(self, loss, weights):
        super().__init__()
        self.loss = loss
        self.weights = weights

    def forward(self, outputs, targets):
        return sum(w * self.loss(o, t) for w, o, t in zip(self.weights, outputs, targets) if w != 0)


def train_one_epoch(model, loader, loss_fn, optimizer, scaler, device):
    model.train()
    for images, masks in loader:
        images, masks = images.to(device, non_blocking=True), masks.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
            targets = [F.interpolate(masks, size=o.shape[-2:], mode="nearest") for o in outputs]
            loss = loss_fn(outputs, targets)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    bce_total, dices = 0.0, []
    for images, masks in loader:
        masks = masks.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            probs = torch.sigmoid(model(images.to(device)))
            bce_total += F.binary_cross_entropy(probs, masks).item()  # expect: AMP003
        pred = (probs > 0.5).float()
        inter = (pred * masks).sum(dim=(2, 3))
        dices.append((2 * inter / (pred.sum(dim=(2, 3)) + masks.sum(dim=(2, 3)) + 1e-8)).cpu())
    return bce_total / len(loader), torch.cat(dices).mean().item()


@torch.inference_mode()
def predict_volume(model, volume, device):
    net = model.module if isinstance(model, DDP) else model
    net = net.eval().half()
    out = []
    for z in range(volume.shape[0]):
        img = torch.from_numpy(volume[z][None, None]).to(device).half()
        out.append(torch.sigmoid(net(img)).float().cpu())
    return torch.cat(out).numpy()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--plans", default="2d_instnorm", choices=sorted(PLANS))
    p.add_argument("--num-classes", type=int, default=13)
    p.add_argument("--epochs", type=int, default=1000)
    args = p.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    plans = PLANS[args.plans]
    model = UNet(plans, in_channels=1, num_classes=args.num_classes)
    model.to(device)
    if distributed:
        model = DDP(model, device_ids=[local_rank])
    weights = np.array([1 / (2 ** i) for i in range(len(plans["features"]) - 1)])
    weights[-1] = 0.0
    weights = weights / weights.sum()
    loss_fn = DeepSupervisionLoss(DiceBCELoss(), weights.tolist())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.amp.GradScaler("cuda")
    train_loader, val_loader = torch.load("cache/loaders.pt")
    for epoch in range(args.epochs):
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (1 - epoch / args.epochs) ** 0.9
        train_one_epoch(model, train_loader, loss_fn, optimizer, scaler, device)
        val_bce, val_dice = validate(model, val_loader, device)
        if local_rank == 0:
            print(f"epoch {epoch} val bce {val_bce:.4f} dice {val_dice:.4f}")
            torch.save(model.state_dict(), "checkpoint_latest.pt")


if __name__ == "__main__":
    main()
