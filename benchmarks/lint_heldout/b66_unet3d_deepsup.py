"""Residual-encoder 3D U-Net with attention-gated skips and deep supervision,
trained with Dice + CE in the nnU-Net style (poly LR, SGD+Nesterov, grad clip 12).
"""
import argparse
import copy
from contextlib import nullcontext
import logging
import os
from time import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from seg3d.data import get_patch_loaders, downsample_seg_for_ds
from seg3d.utils import PolyLRScheduler, save_json

logger = logging.getLogger("unet3d")


# --------------------------------------------------------------------------- #
# channel recalibration blocks
# --------------------------------------------------------------------------- #
class SqueezeExcite3d(nn.Module):
    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Conv3d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv3d(channels // reduction, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3, 4), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s), inplace=True)))
        return x * s


class StyleRecalibration3d(nn.Module):
    """SRM (Lee et al. 2019): style pooling (mean, std) + channel-wise integration."""

    def __init__(self, channels):
        super().__init__()
        self.cfc = nn.Parameter(torch.zeros(channels, 2))
        self.bn = nn.BatchNorm1d(channels)

    def forward(self, x):
        b, c = x.shape[:2]
        flat = x.view(b, c, -1)
        mean = flat.mean(dim=-1, keepdim=True)  # expect: AMP004
        std = flat.std(dim=-1, keepdim=True)  # expect: AMP004
        t = torch.cat((mean, std), dim=-1)                  # b, c, 2
        z = (t * self.cfc[None]).sum(dim=-1)                 # b, c
        g = torch.sigmoid(self.bn(z))
        return x * g.view(b, c, 1, 1, 1)


def make_recalibration(kind, channels):
    if kind == "se":
        return SqueezeExcite3d(channels)
    if kind == "srm":
        return StyleRecalibration3d(channels)
    return nn.Identity()


# --------------------------------------------------------------------------- #
# encoder / decoder
# --------------------------------------------------------------------------- #
class ResidualBlock3d(nn.Module):
    def __init__(self, in_ch, out_ch, stride, recal):
        super().__init__()
        self.conv1 = nn.Conv3d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.norm1 = nn.InstanceNorm3d(out_ch, affine=True)
        self.conv2 = nn.Conv3d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.recal = make_recalibration(recal, out_ch)
        self.norm2 = nn.InstanceNorm3d(out_ch, affine=True)
        self.nonlin = nn.LeakyReLU(0.01, inplace=True)
        self.skip = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.skip = nn.Sequential(nn.Conv3d(in_ch, out_ch, 1, stride, bias=False),
                                      nn.InstanceNorm3d(out_ch, affine=True))

    def forward(self, x):
        residual = self.skip(x)
        out = self.nonlin(self.norm1(self.conv1(x)))
        out = self.recal(self.conv2(out))
        return self.nonlin(self.norm2(out) + residual)


class AttentionGate3d(nn.Module):
    def __init__(self, g_ch, x_ch, inter_ch, normalize="max"):
        super().__init__()
        self.W_g = nn.Conv3d(g_ch, inter_ch, 1)
        self.W_x = nn.Conv3d(x_ch, inter_ch, 1, bias=False)
        self.psi = nn.Conv3d(inter_ch, 1, 1)
        self.normalize = normalize

    def forward(self, g, x):
        psi = torch.sigmoid(self.psi(F.relu(self.W_g(g) + self.W_x(x))))
        if self.normalize == "max":
            psi = psi / (psi.amax(dim=(2, 3, 4), keepdim=True) + 1e-8)  # expect: AMP011
        elif self.normalize == "sum":
            psi = psi * psi[0, 0].numel() / (psi.sum(dim=(2, 3, 4), keepdim=True) + 1e-8)
        return x * psi


class ResEncUNet3d(nn.Module):
    def __init__(self, in_channels, num_classes, features_per_stage=(32, 64, 128, 256, 320),
                 blocks_per_stage=(1, 3, 4, 6, 6), recal="se", deep_supervision=True, gate_norm="max"):
        super().__init__()
        self.deep_supervision = deep_supervision
        self.stem = nn.Conv3d(in_channels, features_per_stage[0], 3, 1, 1)
        self.encoder = nn.ModuleList()
        prev = features_per_stage[0]
        for s, (feat, n_blocks) in enumerate(zip(features_per_stage, blocks_per_stage)):
            stride = 1 if s == 0 else 2
            blocks = [ResidualBlock3d(prev, feat, stride, recal)]
            blocks += [ResidualBlock3d(feat, feat, 1, recal) for _ in range(n_blocks - 1)]
            self.encoder.append(nn.Sequential(*blocks))
            prev = feat

        self.upsample = nn.ModuleList()
        self.gates = nn.ModuleList()
        self.decoder = nn.ModuleList()
        self.seg_layers = nn.ModuleList()
        for s in range(len(features_per_stage) - 1, 0, -1):
            below, skip = features_per_stage[s], features_per_stage[s - 1]
            self.upsample.append(nn.ConvTranspose3d(below, skip, 2, 2, bias=False))
            self.gates.append(AttentionGate3d(skip, skip, max(skip // 2, 8), normalize=gate_norm))
            self.decoder.append(ResidualBlock3d(2 * skip, skip, 1, recal="none"))
            self.seg_layers.append(nn.Conv3d(skip, num_classes, 1))

    def forward(self, x):
        skips = []
        x = self.stem(x)
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        seg_outputs = []
        for up, gate, dec, seg in zip(self.upsample, self.gates, self.decoder, self.seg_layers):
            skip = skips.pop()
            x = up(x)
            x = dec(torch.cat((gate(x, skip), x), dim=1))
            seg_outputs.append(seg(x))
        seg_outputs = seg_outputs[::-1]
        return seg_outputs if self.deep_supervision else seg_outputs[0]


# --------------------------------------------------------------------------- #
# losses
# --------------------------------------------------------------------------- #
class SoftDiceLoss(nn.Module):
    def __init__(self, smooth=1e-5, do_bg=False):
        super().__init__()
        self.smooth, self.do_bg = smooth, do_bg

    def forward(self, logits, target_onehot):
        probs = torch.softmax(logits, dim=1)
        if not self.do_bg:
            probs, target_onehot = probs[:, 1:], target_onehot[:, 1:]
        axes = tuple(range(2, probs.ndim))
        tp = (probs * target_onehot).sum(axes)
        fp = (probs * (1 - target_onehot)).sum(axes)
        fn = ((1 - probs) * target_onehot).sum(axes)
        dc = (2 * tp + self.smooth) / torch.clip(2 * tp + fp + fn + self.smooth, 1e-8)
        return -dc.mean()


class DiceCELoss(nn.Module):
    def __init__(self, weight_ce=1.0, weight_dice=1.0):
        super().__init__()
        self.dice = SoftDiceLoss()
        self.weight_ce, self.weight_dice = weight_ce, weight_dice

    def forward(self, logits, target):
        onehot = torch.zeros_like(logits).scatter_(1, target.long(), 1)
        ce = F.cross_entropy(logits, target[:, 0].long())
        return self.weight_ce * ce + self.weight_dice * self.dice(logits, onehot)


class DeepSupervisionWrapper(nn.Module):
    def __init__(self, loss, weight_factors):
        super().__init__()
        self.loss = loss
        self.weight_factors = weight_factors

    def forward(self, *args):
        return sum(w * self.loss(*inputs) for w, inputs in zip(self.weight_factors, zip(*args)) if w != 0.0)


# --------------------------------------------------------------------------- #
# trainer
# --------------------------------------------------------------------------- #
def make_grad_scaler(device):
    if device.type != "cuda":
        return None
    try:
        return torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler()


class SegTrainer:
    def __init__(self, plans, fold, output_dir, device=torch.device("cuda")):
        self.plans, self.fold, self.output_dir, self.device = plans, fold, output_dir, device
        self.num_epochs = plans["num_epochs"]
        self.network = ResEncUNet3d(plans["in_channels"], plans["num_classes"],
                                    features_per_stage=plans["features_per_stage"],
                                    blocks_per_stage=plans["blocks_per_stage"], recal=plans.get("recal", "se"),
                                    deep_supervision=True).to(device)
        self.optimizer = torch.optim.SGD(self.network.parameters(), plans["initial_lr"], momentum=0.99,
                                         nesterov=True, weight_decay=3e-5)
        self.lr_scheduler = PolyLRScheduler(self.optimizer, plans["initial_lr"], self.num_epochs)
        self.grad_scaler = make_grad_scaler(device)
        n_ds = len(plans["features_per_stage"]) - 1
        weights = np.array([1 / (2 ** i) for i in range(n_ds)])
        weights[-1] = 0
        self.loss = DeepSupervisionWrapper(DiceCELoss(), list(weights / weights.sum()))

    def train_step(self, batch):
        data = batch["data"].to(self.device, non_blocking=True)
        target = [t.to(self.device, non_blocking=True) for t in batch["target"]]
        self.optimizer.zero_grad(set_to_none=True)
        ctx = torch.autocast("cuda", dtype=torch.float16) if self.device.type == "cuda" else nullcontext()
        with ctx:
            output = self.network(data)
            l = self.loss(output, target)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(l).backward()
            self.grad_scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), 12)
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            l.backward()
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), 12)
            self.optimizer.step()
        return l.detach().cpu().numpy()

    @torch.no_grad()
    def validation_step(self, batch):
        self.network.eval()
        data = batch["data"].to(self.device)
        target = batch["target"][0].to(self.device)
        with torch.autocast("cuda", dtype=torch.float16):
            output = self.network(data)[0]
            l = self.loss.loss(output, target)
        pred = output.argmax(1, keepdim=True)
        onehot_pred = torch.zeros_like(output).scatter_(1, pred, 1)
        onehot_gt = torch.zeros_like(output).scatter_(1, target.long(), 1)
        axes = (0, 2, 3, 4)
        tp = (onehot_pred * onehot_gt).sum(axes)
        fp = (onehot_pred * (1 - onehot_gt)).sum(axes)
        fn = ((1 - onehot_pred) * onehot_gt).sum(axes)
        return {"loss": l.item(), "tp": tp.cpu().numpy(), "fp": fp.cpu().numpy(), "fn": fn.cpu().numpy()}

    def export_half_weights(self, path):
        # compact inference checkpoint (weights only, fp16)
        net = copy.deepcopy(self.network).half()
        torch.save(net.state_dict(), path)

    def run_training(self, train_loader, val_loader, iters_per_epoch=250, val_iters=50):
        best_dice = -1.0
        for epoch in range(self.num_epochs):
            self.network.train()
            self.lr_scheduler.step(epoch)
            t0 = time()
            losses = [self.train_step(next(train_loader)) for _ in range(iters_per_epoch)]
            outs = [self.validation_step(next(val_loader)) for _ in range(val_iters)]
            tp = np.sum([o["tp"] for o in outs], 0)
            fp = np.sum([o["fp"] for o in outs], 0)
            fn = np.sum([o["fn"] for o in outs], 0)
            dice = 2 * tp / np.clip(2 * tp + fp + fn, 1e-8, None)
            mean_dice = float(np.nanmean(dice[1:]))
            logger.info("epoch %d train %.4f val %.4f pseudo-dice %.4f (%.1fs)", epoch, float(np.mean(losses)),
                        float(np.mean([o["loss"] for o in outs])), mean_dice, time() - t0)
            if mean_dice > best_dice:
                best_dice = mean_dice
                torch.save({"network_weights": self.network.state_dict(), "epoch": epoch,
                            "optimizer_state": self.optimizer.state_dict(),
                            "grad_scaler_state": self.grad_scaler.state_dict() if self.grad_scaler else None},
                           os.path.join(self.output_dir, "checkpoint_best.pth"))
        self.export_half_weights(os.path.join(self.output_dir, "model_final_fp16.pth"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("plans")
    parser.add_argument("fold", type=int)
    parser.add_argument("-o", "--output", default="results/resenc_unet3d")
    args = parser.parse_args()
    plans = np.load(args.plans, allow_pickle=True).item()
    out_dir = os.path.join(args.output, f"fold_{args.fold}")
    os.makedirs(out_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO)
    train_loader, val_loader = get_patch_loaders(plans, args.fold, ds_transform=downsample_seg_for_ds)
    trainer = SegTrainer(plans, args.fold, out_dir)
    trainer.run_training(train_loader, val_loader)
    save_json({"fold": args.fold, "plans": args.plans}, os.path.join(out_dir, "run.json"))


if __name__ == "__main__":
    main()
