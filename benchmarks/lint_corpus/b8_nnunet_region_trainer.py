"""Region-based 3D segmentation trainer (BraTS: whole tumour / tumour core / enhancing tumour).

Modelled on nnU-Net v2's nnUNetTrainer: PlainConvUNet with deep supervision, poly LR,
SGD + Nesterov, sigmoid outputs with BCE + soft Dice per region, online pseudo-Dice.
"""
import os
from time import time

import numpy as np
import torch
from torch import nn, autocast
from torch.cuda.amp import GradScaler
from torch.optim.lr_scheduler import _LRScheduler


class dummy_context(object):
    def __enter__(self):
        pass

    def __exit__(self, exc_type, exc_val, exc_tb):
        pass


class PolyLRScheduler(_LRScheduler):
    def __init__(self, optimizer, initial_lr, max_steps, exponent=0.9, current_step=None):
        self.optimizer = optimizer
        self.initial_lr = initial_lr
        self.max_steps = max_steps
        self.exponent = exponent
        self.ctr = 0
        super().__init__(optimizer, current_step if current_step is not None else -1, False)

    def step(self, current_step=None):
        if current_step is None or current_step == -1:
            current_step = self.ctr
            self.ctr += 1
        new_lr = self.initial_lr * (1 - current_step / self.max_steps) ** self.exponent
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = new_lr


class ConvStage(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv3d(cin, cout, 3, stride, 1), nn.InstanceNorm3d(cout, eps=1e-5, affine=True), nn.LeakyReLU(inplace=True),
            nn.Conv3d(cout, cout, 3, 1, 1), nn.InstanceNorm3d(cout, eps=1e-5, affine=True), nn.LeakyReLU(inplace=True))

    def forward(self, x):
        return self.block(x)


class PlainConvUNet3d(nn.Module):
    def __init__(self, in_channels, num_classes, features=(32, 64, 128, 256, 320), deep_supervision=True):
        super().__init__()
        self.deep_supervision = deep_supervision
        self.encoder = nn.ModuleList()
        cin = in_channels
        for i, f in enumerate(features):
            self.encoder.append(ConvStage(cin, f, 1 if i == 0 else 2))
            cin = f
        self.ups, self.decoders, self.seg_heads = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for f_below, f in zip(features[::-1][:-1], features[::-1][1:]):
            self.ups.append(nn.ConvTranspose3d(f_below, f, 2, 2, bias=False))
            self.decoders.append(ConvStage(2 * f, f, 1))
            self.seg_heads.append(nn.Conv3d(f, num_classes, 1))

    def forward(self, x):
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        outputs = []
        for up, dec, seg in zip(self.ups, self.decoders, self.seg_heads):
            x = dec(torch.cat((up(x), skips.pop()), 1))
            outputs.append(seg(x))
        outputs = outputs[::-1]
        return outputs if self.deep_supervision else outputs[0]


class SoftDiceLoss(nn.Module):
    def __init__(self, apply_nonlin=None, batch_dice=False, do_bg=True, smooth=1e-5):
        super().__init__()
        self.apply_nonlin = apply_nonlin
        self.batch_dice = batch_dice
        self.do_bg = do_bg
        self.smooth = smooth

    def forward(self, x, y):
        if self.apply_nonlin is not None:
            x = self.apply_nonlin(x)
        axes = tuple(range(2, x.ndim))
        if self.batch_dice:
            axes = (0,) + axes
        with torch.no_grad():
            y_onehot = y.to(torch.bool)
        if not self.do_bg:
            x, y_onehot = x[:, 1:], y_onehot[:, 1:]
        intersect = (x * y_onehot).sum(axes)
        sum_pred = x.sum(axes)
        sum_gt = y_onehot.sum(axes)
        dc = (2 * intersect + self.smooth) / torch.clip(sum_gt + sum_pred + self.smooth, 1e-8)
        return -dc.mean()


class DC_and_BCE_loss(nn.Module):
    def __init__(self, bce_kwargs, soft_dice_kwargs, weight_ce=1, weight_dice=1):
        super().__init__()
        self.weight_dice = weight_dice
        self.weight_ce = weight_ce
        self.ce = nn.BCELoss(**bce_kwargs)
        self.dc = SoftDiceLoss(apply_nonlin=torch.sigmoid, **soft_dice_kwargs)

    def forward(self, net_output, target):
        dc_loss = self.dc(net_output, target)
        ce_loss = self.ce(torch.sigmoid(net_output), target.float())  # expect: AMP003
        return self.weight_ce * ce_loss + self.weight_dice * dc_loss


class DeepSupervisionWrapper(nn.Module):
    def __init__(self, loss, weight_factors=None):
        super().__init__()
        self.weight_factors = tuple(weight_factors) if weight_factors is not None else None
        self.loss = loss

    def forward(self, *args):
        weights = self.weight_factors if self.weight_factors is not None else (1,) * len(args[0])
        return sum([weights[i] * self.loss(*inputs) for i, inputs in enumerate(zip(*args)) if weights[i] != 0.0])


def get_tp_fp_fn(pred_onehot, gt, axes):
    tp = (pred_onehot * gt).sum(dim=axes)
    fp = (pred_onehot * (1 - gt)).sum(dim=axes)
    fn = ((1 - pred_onehot) * gt).sum(dim=axes)
    return tp, fp, fn


class RegionUNetTrainer(object):
    def __init__(self, in_channels, regions, output_folder, device=torch.device("cuda")):
        self.device = device
        self.in_channels = in_channels
        self.regions = regions
        self.output_folder = output_folder
        self.initial_lr = 1e-2
        self.weight_decay = 3e-5
        self.num_iterations_per_epoch = 250
        self.num_val_iterations_per_epoch = 50
        self.num_epochs = 1000
        self.current_epoch = 0
        self.grad_scaler = GradScaler() if self.device.type == "cuda" else None  # expect: AMP009
        self.network = self.optimizer = self.lr_scheduler = self.loss = None
        self.ema_pseudo_dice = None

    def initialize(self):
        self.network = PlainConvUNet3d(self.in_channels, len(self.regions)).to(self.device)
        self.optimizer = torch.optim.SGD(self.network.parameters(), self.initial_lr, weight_decay=self.weight_decay,
                                         momentum=0.99, nesterov=True)
        self.lr_scheduler = PolyLRScheduler(self.optimizer, self.initial_lr, self.num_epochs)
        self.loss = self._build_loss()

    def _build_loss(self):
        loss = DC_and_BCE_loss({}, {"batch_dice": True, "do_bg": True, "smooth": 1e-5})
        weights = np.array([1 / (2 ** i) for i in range(len(self.network.seg_heads))])
        weights[-1] = 0
        return DeepSupervisionWrapper(loss, weights / weights.sum())

    def _prepare_batch(self, batch):
        # 4 modalities x 128^3 patches: ship them as half, halves the host-to-device copy
        data = batch["data"].to(self.device, non_blocking=True).half()  # expect: AMP001
        target = [t.to(self.device, non_blocking=True) for t in batch["target"]]
        return data, target

    def _optimizer_step(self):
        self.grad_scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.network.parameters(), 12)
        self.grad_scaler.step(self.optimizer)  # expect: AMP006

    def train_step(self, batch):
        data, target = self._prepare_batch(batch)
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device.type, enabled=True) if self.device.type == "cuda" else dummy_context():
            output = self.network(data)
            l = self.loss(output, target)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(l).backward()
            self._optimizer_step()
        else:
            l.backward()
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), 12)
            self.optimizer.step()
        return {"loss": l.detach().cpu().numpy()}

    def validation_step(self, batch):
        data, target = self._prepare_batch(batch)
        with torch.no_grad():
            with autocast(self.device.type, enabled=True) if self.device.type == "cuda" else dummy_context():
                output = self.network(data)
            l = self.loss(output, target)  # expect: AMP002
            output, target = output[0], target[0]
            axes = [0] + list(range(2, output.ndim))
            predicted = (torch.sigmoid(output) > 0.5).long()
            tp, fp, fn = get_tp_fp_fn(predicted, target.long(), axes=axes)
        return {"loss": l.detach().cpu().numpy(), "tp_hard": tp.cpu().numpy(), "fp_hard": fp.cpu().numpy(),
                "fn_hard": fn.cpu().numpy()}

    def on_validation_epoch_end(self, val_outputs):
        tp = np.sum([o["tp_hard"] for o in val_outputs], 0)
        fp = np.sum([o["fp_hard"] for o in val_outputs], 0)
        fn = np.sum([o["fn_hard"] for o in val_outputs], 0)
        dice_per_region = [2 * i / (2 * i + j + k) for i, j, k in zip(tp, fp, fn)]
        mean_fg_dice = float(np.nanmean(dice_per_region))
        self.ema_pseudo_dice = mean_fg_dice if self.ema_pseudo_dice is None else self.ema_pseudo_dice * 0.9 + 0.1 * mean_fg_dice
        print(f"val loss {np.mean([o['loss'] for o in val_outputs]):.4f}  pseudo dice {dice_per_region}  ema {self.ema_pseudo_dice:.4f}")

    def save_checkpoint(self, filename):
        torch.save({
            "network_weights": self.network.state_dict(),
            "optimizer_state": self.optimizer.state_dict(),
            "grad_scaler_state": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "current_epoch": self.current_epoch + 1,
        }, os.path.join(self.output_folder, filename))

    def run_training(self, dataloader_train, dataloader_val):
        self.initialize()
        for epoch in range(self.current_epoch, self.num_epochs):
            self.current_epoch = epoch
            self.network.train()
            self.lr_scheduler.step(epoch)
            t0 = time()
            train_losses = [self.train_step(next(dataloader_train))["loss"] for _ in range(self.num_iterations_per_epoch)]
            self.network.eval()
            val_outputs = [self.validation_step(next(dataloader_val)) for _ in range(self.num_val_iterations_per_epoch)]
            print(f"epoch {epoch}: train loss {np.mean(train_losses):.4f} lr {self.optimizer.param_groups[0]['lr']:.5f} ({time() - t0:.0f}s)")
            self.on_validation_epoch_end(val_outputs)
            if (epoch + 1) % 50 == 0 or epoch == self.num_epochs - 1:
                self.save_checkpoint("checkpoint_latest.pth")
