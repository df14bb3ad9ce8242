"""Precipitation nowcasting with an attention U-Net.

Predicts the next ``out_frames`` radar rain-rate frames (mm/h) from the last
``in_frames`` observations.  Multi-GPU training with DDP and mixed precision.

    torchrun --nproc_per_node=4 nowcast_unet.py --data /data/radar --epochs 50
"""
import argparse
import copy
import os
from dataclasses import dataclass
from functools import partial
from typing import Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class NowcastConfig:
    in_frames: int = 4
    out_frames: int = 12
    base_channels: int = 32
    depth: int = 4
    use_se: bool = True
    groups: int = 8
    lr: float = 3e-4
    weight_decay: float = 1e-2
    clip_grad: float = 1.0
    amp: bool = True
    epochs: int = 50
    batch_size: int = 8
    thresholds: Tuple[float, ...] = (0.5, 2.0, 5.0, 10.0, 30.0)
    mask_weight: float = 0.1
    smooth_weight: float = 0.01


class RadarSequenceDataset(Dataset):
    """Sliding windows over daily ``.npy`` stacks of dBZ composites."""

    def __init__(self, root, in_frames, out_frames, split="train"):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))
        self.in_frames, self.out_frames = in_frames, out_frames
        self.window = in_frames + out_frames
        self.index = []
        for fi, path in enumerate(self.files):
            n = np.load(path, mmap_mode="r").shape[0]
            self.index.extend((fi, s) for s in range(0, n - self.window + 1, 2))

    def __len__(self):
        return len(self.index)

    @staticmethod
    def dbz_to_rain(dbz):
        dbz = np.nan_to_num(np.clip(dbz, 0.0, 70.0), nan=0.0)
        return ((10.0 ** (dbz / 10.0)) / 200.0) ** (1.0 / 1.6)

    def __getitem__(self, i):
        fi, s = self.index[i]
        seq = np.asarray(np.load(self.files[fi], mmap_mode="r")[s:s + self.window], dtype=np.float32)
        rain = self.dbz_to_rain(seq).astype(np.float32)
        return {"input": torch.from_numpy(seq[: self.in_frames] / 70.0), "target": torch.from_numpy(rain[self.in_frames:])}


def conv3x3(in_ch, out_ch, stride=1):
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        hidden = max(channels // reduction, 8)
        self.fc1 = nn.Conv2d(channels, hidden, 1)
        self.fc2 = nn.Conv2d(hidden, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        s = self.fc2(F.relu(self.fc1(s), inplace=True))
        return x * torch.sigmoid(s)


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, norm_layer, use_se=True):
        super().__init__()
        self.conv1 = conv3x3(in_ch, out_ch)
        self.norm1 = norm_layer(out_ch)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.norm2 = norm_layer(out_ch)
        self.se = SqueezeExcite(out_ch) if use_se else nn.Identity()
        self.skip = nn.Conv2d(in_ch, out_ch, 1, bias=False) if in_ch != out_ch else nn.Identity()

    def forward(self, x):
        h = F.silu(self.norm1(self.conv1(x)))
        h = self.se(self.conv2(h))
        return F.silu(self.norm2(h) + self.skip(x))


class AttentionGate(nn.Module):
    """Additive attention gate on the skip connection (Oktay et al., 2018)."""

    def __init__(self, skip_ch, gate_ch, inter_ch):
        super().__init__()
        self.wx = nn.Conv2d(skip_ch, inter_ch, 1, bias=False)
        self.wg = nn.Conv2d(gate_ch, inter_ch, 1)
        self.psi = nn.Conv2d(inter_ch, 1, 1)

    def forward(self, skip, gate):
        g = F.interpolate(self.wg(gate), size=skip.shape[-2:], mode="bilinear", align_corners=False)
        a = F.relu(self.psi(F.relu(self.wx(skip) + g)))
        # peak-normalised gate, so that the strongest echo passes unattenuated
        a = a / (a.amax(dim=(2, 3), keepdim=True) + 1e-8)  # expect: AMP011
        return skip * a


class NowcastUNet(nn.Module):
    def __init__(self, cfg: NowcastConfig):
        super().__init__()
        norm_layer = partial(nn.GroupNorm, cfg.groups)
        chs = [cfg.base_channels * 2 ** i for i in range(cfg.depth + 1)]
        self.stem = conv3x3(cfg.in_frames, chs[0])
        self.pool = nn.MaxPool2d(2)
        self.down = nn.ModuleList()
        for i in range(cfg.depth):
            self.down.append(ResBlock(chs[i], chs[i + 1], norm_layer, cfg.use_se))
        self.skip_proj = nn.ModuleList([nn.Conv2d(c, c, 1) for c in chs[:-1]])
        self.gates = nn.ModuleList()
        self.up = nn.ModuleList()
        for i in reversed(range(cfg.depth)):
            self.gates.append(AttentionGate(chs[i], chs[i + 1], max(chs[i] // 2, 8)))
            self.up.append(ResBlock(chs[i] + chs[i + 1], chs[i], norm_layer, cfg.use_se))
        self.head = nn.Conv2d(chs[0], cfg.out_frames, 1)
        self.mask_head = nn.Conv2d(chs[0], cfg.out_frames, 1)

    @staticmethod
    def _standardize(h):
        return (h - h.mean(dim=1, keepdim=True)) / (h.std(dim=1, keepdim=True) + 1e-5)  # expect: AMP004

    def forward(self, x):
        # per-sample standardisation of the reflectivity input
        x = (x - x.mean(dim=(1, 2, 3), keepdim=True)) / (x.std(dim=(1, 2, 3), keepdim=True) + 1e-6)
        h = F.silu(self.stem(x))
        skips = []
        for i, block in enumerate(self.down):
            skips.append(self._standardize(self.skip_proj[i](h)))
            h = block(self.pool(h))
        for gate, block, skip in zip(self.gates, self.up, reversed(skips)):
            g = gate(skip, h)
            h = F.interpolate(h, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            h = block(torch.cat([g, h], dim=1))
        rain = F.relu(self.head(h))
        return rain, self.mask_head(h)


def build_model(cfg: NowcastConfig) -> nn.Module:
    model = NowcastUNet(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"NowcastUNet: {n_params / 1e6:.2f}M parameters")
    return model


def temporal_smoothness(frames):
    """Mean absolute change between consecutive predicted frames."""
    return (frames[:, 1:] - frames[:, :-1]).abs().mean()  # expect: AMP004


class NowcastLoss(nn.Module):
    """Intensity-balanced MSE + MAE, a log-space term and a rain/no-rain mask term."""

    def __init__(self, thresholds, weights=(1.0, 2.0, 5.0, 10.0, 30.0), mask_weight=0.1):
        super().__init__()
        self.register_buffer("thresholds", torch.tensor(thresholds, dtype=torch.float32))
        self.register_buffer("weights", torch.tensor(weights, dtype=torch.float32))
        self.mask_weight = mask_weight

    def pixel_weights(self, target):
        w = torch.ones_like(target)
        for t, wt in zip(self.thresholds, self.weights):
            w = torch.where(target >= t, wt, w)
        return w

    def forward(self, pred, mask_logits, target, rain_mask):
        w = self.pixel_weights(target)
        mse = (w * F.mse_loss(pred, target, reduction="none")).mean()
        mae = (w * F.l1_loss(pred, target, reduction="none")).mean()
        log_err = F.l1_loss(torch.log(pred + 1e-10), torch.log(target + 1e-10))  # expect: AMP011
        mask_loss = F.binary_cross_entropy(torch.sigmoid(mask_logits), rain_mask)  # expect: AMP003
        return mse + mae + 0.1 * log_err + self.mask_weight * mask_loss


class Trainer:
    def __init__(self, cfg: NowcastConfig, local_rank: int = 0):
        self.cfg = cfg
        self.device = torch.device("cuda", local_rank)
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        model = build_model(cfg).to(self.device)
        self.model = DDP(model, device_ids=[local_rank]) if dist.is_initialized() else model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, eps=1e-8)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.criterion = NowcastLoss(cfg.thresholds, mask_weight=cfg.mask_weight).to(self.device)
        self.best_score = -1e9

    def train_step(self, batch):
        x = batch["input"].to(self.device, non_blocking=True)
        y = batch["target"].to(self.device, non_blocking=True)
        rain_mask = (y > self.cfg.thresholds[0]).float()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            rain, mask_logits = self.model(x)
            loss = self.criterion(rain, mask_logits, y, rain_mask)
            loss = loss + self.cfg.smooth_weight * temporal_smoothness(rain)
        self.scaler.scale(loss).backward()
        if self.cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        n_thr = len(self.cfg.thresholds)
        hits = torch.zeros(n_thr, device=self.device)
        misses = torch.zeros(n_thr, device=self.device)
        false_alarms = torch.zeros(n_thr, device=self.device)
        sq_err = torch.zeros((), device=self.device)
        n_pix = 0
        for batch in loader:
            x = batch["input"].to(self.device, non_blocking=True)
            y = batch["target"].to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                rain, _ = self.model(x)
            rain = rain.float()
            for k, t in enumerate(self.cfg.thresholds):
                p, o = rain >= t, y >= t
                hits[k] += (p & o).sum()
                misses[k] += (~p & o).sum()
                false_alarms[k] += (p & ~o).sum()
            sq_err += (rain - y).pow(2).sum()
            n_pix += y.numel()
        if dist.is_initialized():
            for t in (hits, misses, false_alarms, sq_err):
                dist.all_reduce(t)
        csi = hits / (hits + misses + false_alarms).clamp(min=1)
        self.model.train()
        return csi.cpu().numpy(), float((sq_err / max(n_pix, 1)).sqrt())

    def fit(self, train_loader, val_loader, out_dir):
        for epoch in range(self.cfg.epochs):
            if isinstance(train_loader.sampler, DistributedSampler):
                train_loader.sampler.set_epoch(epoch)
            self.model.train()
            running, steps = 0.0, 0
            for batch in train_loader:
                running += self.train_step(batch).item()
                steps += 1
            csi, rmse = self.evaluate(val_loader)
            score = float(np.mean(csi))
            if self.is_main:
                print(f"epoch {epoch}: loss {running / max(steps, 1):.4f} rmse {rmse:.3f} csi {np.round(csi, 3)}")
                if score > self.best_score:
                    self.best_score = score
                    module = self.model.module if isinstance(self.model, DDP) else self.model
                    torch.save({"model": module.state_dict(), "cfg": self.cfg, "epoch": epoch}, os.path.join(out_dir, "best.pt"))


def export_fp16_checkpoint(model, path):
    """Half-precision weights for the serving container."""
    module = model.module if isinstance(model, DDP) else model
    torch.save(copy.deepcopy(module).half().state_dict(), path)


def main():
    parser = argparse.ArgumentParser(description="Radar nowcasting U-Net")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="runs/nowcast")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--no-amp", action="store_true")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()

    cfg = NowcastConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, amp=not args.no_amp)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    os.makedirs(args.out, exist_ok=True)

    train_set = RadarSequenceDataset(args.data, cfg.in_frames, cfg.out_frames, "train")
    val_set = RadarSequenceDataset(args.data, cfg.in_frames, cfg.out_frames, "val")
    train_sampler = DistributedSampler(train_set) if dist.is_initialized() else None
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler, shuffle=train_sampler is None, num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, num_workers=args.workers, pin_memory=True)

    trainer = Trainer(cfg, local_rank)
    trainer.fit(train_loader, val_loader, args.out)
    if trainer.is_main:
        export_fp16_checkpoint(trainer.model, os.path.join(args.out, "nowcast_fp16.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
