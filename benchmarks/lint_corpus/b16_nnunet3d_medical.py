"""nnU-Net style 3D residual U-Net trainer for region-based BraTS segmentation.

Region-based training (whole tumour / tumour core / enhancing) uses sigmoid outputs with
Dice + BCE, and deep supervision on every decoder resolution. Older checkpoints were
trained with torch.cuda.amp; this trainer keeps that scaler for reproducibility.
"""
import argparse
import os
from time import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------- network
class SqueezeExcite3d(nn.Module):
    def __init__(self, ch, rd_ratio=1.0 / 16):
        super().__init__()
        rd = max(8, int(ch * rd_ratio))
        self.fc1 = nn.Conv3d(ch, rd, 1)
        self.fc2 = nn.Conv3d(rd, ch, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3, 4), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class ResBlock3d(nn.Module):
    def __init__(self, in_ch, out_ch, stride, use_se=True):
        super().__init__()
        self.conv1 = nn.Conv3d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.norm1 = nn.InstanceNorm3d(out_ch, affine=True)
        self.conv2 = nn.Conv3d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.norm2 = nn.InstanceNorm3d(out_ch, affine=True)
        self.se = SqueezeExcite3d(out_ch) if use_se else nn.Identity()
        self.skip = nn.Identity() if (in_ch == out_ch and stride == 1) else nn.Sequential(nn.Conv3d(in_ch, out_ch, 1, stride, bias=False), nn.InstanceNorm3d(out_ch, affine=True))

    def forward(self, x):
        out = F.leaky_relu(self.norm1(self.conv1(x)), 0.01)
        out = self.norm2(self.se(self.conv2(out)))
        return F.leaky_relu(out + self.skip(x), 0.01)


class ResEncUNet(nn.Module):
    def __init__(self, in_ch=4, num_regions=3, features=(32, 64, 128, 256, 320, 320), deep_supervision=True):
        super().__init__()
        self.deep_supervision = deep_supervision
        self.encoder = nn.ModuleList()
        ch = in_ch
        for i, f in enumerate(features):
            self.encoder.append(ResBlock3d(ch, f, 1 if i == 0 else 2))
            ch = f
        self.up = nn.ModuleList()
        self.decoder = nn.ModuleList()
        self.seg_layers = nn.ModuleList()
        for i in range(len(features) - 1, 0, -1):
            self.up.append(nn.ConvTranspose3d(features[i], features[i - 1], 2, 2))
            self.decoder.append(ResBlock3d(features[i - 1] * 2, features[i - 1], 1, use_se=False))
            self.seg_layers.append(nn.Conv3d(features[i - 1], num_regions, 1))

    def forward(self, x):
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        seg_outputs = []
        for up, dec, seg in zip(self.up, self.decoder, self.seg_layers):
            x = dec(torch.cat((up(x), skips.pop()), dim=1))
            seg_outputs.append(seg(x))
        seg_outputs = seg_outputs[::-1]
        return seg_outputs if self.deep_supervision else seg_outputs[0]


# ----------------------------------------------------------------------------- losses
class SoftDiceLoss(nn.Module):
    def __init__(self, batch_dice=True, smooth=1e-5):
        super().__init__()
        self.batch_dice, self.smooth = batch_dice, smooth

    def forward(self, x, y):
        axes = [0] + list(range(2, x.ndim)) if self.batch_dice else list(range(2, x.ndim))
        tp = (x * y).sum(dim=axes)
        fp = (x * (1 - y)).sum(dim=axes)
        fn = ((1 - x) * y).sum(dim=axes)
        dc = (2 * tp + self.smooth) / torch.clip(2 * tp + fp + fn + self.smooth, 1e-8)
        return -dc.mean()


class DC_and_BCE_loss(nn.Module):
    def __init__(self, weight_ce=1.0, weight_dice=1.0):
        super().__init__()
        self.weight_ce, self.weight_dice = weight_ce, weight_dice
        self.bce = nn.BCELoss()
        self.dc = SoftDiceLoss()

    def forward(self, net_output, target):
        probs = torch.sigmoid(net_output)
        dc_loss = self.dc(probs, target)
        ce_loss = self.bce(probs, target)  # expect: AMP003
        return self.weight_ce * ce_loss + self.weight_dice * dc_loss


class DeepSupervisionWrapper(nn.Module):
    def __init__(self, loss, weights):
        super().__init__()
        self.loss, self.weights = loss, weights

    def forward(self, *args):
        return sum(w * self.loss(*inputs) for w, *inputs in zip(self.weights, *args) if w != 0)


def clip_gradients(network, max_norm=12.0):
    return torch.nn.utils.clip_grad_norm_(network.parameters(), max_norm)


# ----------------------------------------------------------------------------- trainer
class nnUNetTrainerBraTS:
    def __init__(self, fold, out_dir, device, num_epochs=1000, iters_per_epoch=250, initial_lr=1e-2):
        self.fold, self.out_dir, self.device = fold, out_dir, device
        self.num_epochs, self.iters_per_epoch, self.initial_lr = num_epochs, iters_per_epoch, initial_lr
        self.network = ResEncUNet().to(device)
        self.optimizer = torch.optim.SGD(self.network.parameters(), initial_lr, weight_decay=3e-5, momentum=0.99, nesterov=True)
        self.grad_scaler = torch.cuda.amp.GradScaler() if self.device.type == "cuda" else None  # expect: AMP009
        n = len(self.network.seg_layers)
        weights = np.array([1 / (2 ** i) for i in range(n)])
        weights[-1] = 0
        self.loss = DeepSupervisionWrapper(DC_and_BCE_loss(), list(weights / weights.sum()))
        self.current_epoch = 0
        self.best_ema = None

    def poly_lr(self, epoch):
        return self.initial_lr * (1 - epoch / self.num_epochs) ** 0.9

    def train_step(self, batch):
        data = batch["data"].to(self.device, non_blocking=True)
        target = [t.to(self.device, non_blocking=True).half() for t in batch["target"]]  # expect: AMP001
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.device.type == "cuda"):
            output = self.network(data)
            l = self.loss(output, target)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(l).backward()
            grad_norm = clip_gradients(self.network, 12)  # expect: AMP005
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            l.backward()
            grad_norm = clip_gradients(self.network, 12)
            self.optimizer.step()
        return {"loss": l.detach().cpu().numpy(), "grad_norm": float(grad_norm)}

    def validation_step(self, batch):
        data = batch["data"].to(self.device, non_blocking=True)
        target = [t.to(self.device, non_blocking=True) for t in batch["target"]]
        with torch.no_grad():
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.device.type == "cuda"):
                output = self.network(data)
                l = self.loss(output, target)
            pred = (torch.sigmoid(output[0].float()) > 0.5).float()
            gt = target[0].float()
            axes = [0, 2, 3, 4]
            tp = (pred * gt).sum(axes)
            fp = (pred * (1 - gt)).sum(axes)
            fn = ((1 - pred) * gt).sum(axes)
        return {"loss": l.item(), "tp": tp.cpu().numpy(), "fp": fp.cpu().numpy(), "fn": fn.cpu().numpy()}

    def save_checkpoint(self, name):
        torch.save({
            "network_weights": self.network.state_dict(),
            "optimizer_state": self.optimizer.state_dict(),
            "grad_scaler_state": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "current_epoch": self.current_epoch + 1,
        }, os.path.join(self.out_dir, name))

    def run_training(self, train_gen, val_gen, val_iters=50):
        for epoch in range(self.current_epoch, self.num_epochs):
            self.current_epoch = epoch
            for g in self.optimizer.param_groups:
                g["lr"] = self.poly_lr(epoch)
            self.network.train()
            t0 = time()
            train_losses = [self.train_step(next(train_gen))["loss"] for _ in range(self.iters_per_epoch)]
            self.network.eval()
            outs = [self.validation_step(next(val_gen)) for _ in range(val_iters)]
            tp = np.sum([o["tp"] for o in outs], 0)
            fp = np.sum([o["fp"] for o in outs], 0)
            fn = np.sum([o["fn"] for o in outs], 0)
            dice = 2 * tp / np.clip(2 * tp + fp + fn, 1e-8, None)
            mean_dice = float(np.nanmean(dice))
            self.best_ema = mean_dice if self.best_ema is None else 0.9 * self.best_ema + 0.1 * mean_dice
            print(f"epoch {epoch} train {np.mean(train_losses):.4f} val {np.mean([o['loss'] for o in outs]):.4f} pseudo-dice {np.round(dice, 4)} ({time() - t0:.1f}s)")
            if (epoch + 1) % 50 == 0:
                self.save_checkpoint("checkpoint_latest.pth")
        self.save_checkpoint("checkpoint_final.pth")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset", help="preprocessed dataset folder")
    parser.add_argument("fold", type=int)
    parser.add_argument("-o", "--output", default="nnUNet_results/BraTS_ResEnc")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    os.makedirs(args.output, exist_ok=True)
    trainer = nnUNetTrainerBraTS(args.fold, args.output, torch.device(args.device), num_epochs=args.epochs)
    from nnunet_data import get_dataloaders  # project-local: patch sampling + augmentation

    train_gen, val_gen = get_dataloaders(args.dataset, args.fold, patch_size=(128, 128, 128), batch_size=2, num_regions=3)
    trainer.run_training(train_gen, val_gen)


if __name__ == "__main__":
    main()
