"""Multi-label action recognition (Charades-style) with an R(2+1)D backbone.

Clips arrive from the loader as uint8 tensors of shape (B, C, T, H, W).

    python train_video.py --data-root data/charades --clip-len 16 --amp
"""
import argparse
import copy
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from vidrec.data import CharadesClips, clip_collate
from vidrec.metrics import mean_average_precision
from vidrec.utils import AverageMeter, is_main_process

logger = logging.getLogger("vidrec")

KINETICS_MEAN = (0.432, 0.394, 0.376)
KINETICS_STD = (0.228, 0.221, 0.217)


@dataclass
class Config:
    data_root: str = "data/charades"
    num_classes: int = 157
    clip_len: int = 16
    crop_size: int = 112
    widths: tuple = (64, 128, 256, 512)
    head_dim: int = 512
    attentive_pool: bool = False
    dropout: float = 0.5
    epochs: int = 40
    batch_size: int = 16
    accum_steps: int = 2
    lr: float = 0.05
    weight_decay: float = 1e-4
    clip_grad: float = 1.0
    amp: bool = True
    out_dir: str = "runs/r2plus1d"


class Conv2Plus1D(nn.Sequential):
    def __init__(self, in_planes, out_planes, mid_planes, stride=1):
        super().__init__(
            nn.Conv3d(in_planes, mid_planes, (1, 3, 3), (1, stride, stride), (0, 1, 1), bias=False),
            nn.BatchNorm3d(mid_planes),
            nn.ReLU(inplace=True),
            nn.Conv3d(mid_planes, out_planes, (3, 1, 1), (stride, 1, 1), (1, 0, 0), bias=False),
        )


class SqueezeExcite3D(nn.Module):
    def __init__(self, channels, ratio=16):
        super().__init__()
        self.fc1 = nn.Conv3d(channels, channels // ratio, 1)
        self.fc2 = nn.Conv3d(channels // ratio, channels, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool3d(x, 1)
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class ResBlock(nn.Module):
    def __init__(self, in_planes, planes, stride=1, use_se=False):
        super().__init__()
        mid = (in_planes * planes * 3 * 3 * 3) // (in_planes * 3 * 3 + 3 * planes)
        self.conv1 = Conv2Plus1D(in_planes, planes, mid, stride)
        self.bn1 = nn.BatchNorm3d(planes)
        self.conv2 = Conv2Plus1D(planes, planes, mid)
        self.bn2 = nn.BatchNorm3d(planes)
        self.se = SqueezeExcite3D(planes) if use_se else nn.Identity()
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv3d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm3d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.se(self.bn2(self.conv2(out)))
        return F.relu(out + identity, inplace=True)


class TemporalStatsHead(nn.Module):
    """Spatial average, a temporal conv, then mean/std statistics pooling over time."""

    def __init__(self, in_channels, hidden, num_classes, dropout=0.5, attentive=False):
        super().__init__()
        self.temporal_conv = nn.Conv1d(in_channels, hidden, 3, padding=1)
        self.attentive = attentive
        self.attention = nn.Conv1d(hidden, 1, 1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * hidden, num_classes)

    def forward(self, x):
        x = F.adaptive_avg_pool3d(x, (None, 1, 1)).flatten(2)  # (B, C, T)
        h = F.relu(self.temporal_conv(x))
        if self.attentive:
            w = self.attention(h).softmax(dim=-1)
            mu = (h * w).sum(dim=-1)
            sigma = torch.sqrt((((h ** 2) * w).sum(dim=-1) - mu ** 2).clamp(min=1e-5))
        else:
            mu = h.mean(dim=-1)  # expect: AMP004
            sigma = torch.sqrt(h.var(dim=-1) + 1e-8)  # expect: AMP004 AMP011
        return self.fc(self.dropout(torch.cat([mu, sigma], dim=1)))


class R2Plus1DNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        w = cfg.widths
        self.stem = nn.Sequential(
            nn.Conv3d(3, 45, (1, 7, 7), (1, 2, 2), (0, 3, 3), bias=False),
            nn.BatchNorm3d(45), nn.ReLU(inplace=True),
            nn.Conv3d(45, w[0], (3, 1, 1), 1, (1, 0, 0), bias=False),
            nn.BatchNorm3d(w[0]), nn.ReLU(inplace=True),
        )
        layers, in_planes = [], w[0]
        for i, planes in enumerate(w):
            stride = 1 if i == 0 else 2
            layers += [ResBlock(in_planes, planes, stride, use_se=i >= 2), ResBlock(planes, planes, use_se=i >= 2)]
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.head = TemporalStatsHead(w[-1], cfg.head_dim, cfg.num_classes, cfg.dropout, cfg.attentive_pool)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)))


def build_model(cfg):
    model = R2Plus1DNet(cfg)
    for m in model.modules():
        if isinstance(m, nn.Conv3d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


class Trainer:
    def __init__(self, cfg: Config, device):
        self.cfg = cfg
        self.device = device
        self.model = build_model(cfg).to(device, memory_format=torch.channels_last_3d)
        self.criterion = nn.BCELoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9,
                                         weight_decay=cfg.weight_decay, nesterov=True)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=cfg.epochs)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.mean = torch.tensor(KINETICS_MEAN, device=device).view(1, 3, 1, 1, 1)
        self.std = torch.tensor(KINETICS_STD, device=device).view(1, 3, 1, 1, 1)
        self.start_epoch = 0

    def normalize(self, clips):
        return clips.sub_(self.mean).div_(self.std)

    def train_step(self, clips, labels):
        clips = self.normalize(clips.to(self.device, non_blocking=True).half().div_(255.0))  # expect: AMP001
        labels = labels.to(self.device, non_blocking=True).float()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            logits = self.model(clips)
            loss = self.criterion(torch.sigmoid(logits), labels)  # expect: AMP003
        self.backward(loss)
        return loss.detach()

    def backward(self, loss):
        self.scaler.scale(loss / self.cfg.accum_steps).backward()

    def optimizer_step(self):
        if self.cfg.clip_grad > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def train_epoch(self, loader, epoch):
        self.model.train()
        meter = AverageMeter()
        tic = time.time()
        for i, (clips, labels) in enumerate(loader):
            loss = self.train_step(clips, labels)
            if (i + 1) % self.cfg.accum_steps == 0:
                self.optimizer_step()
            meter.update(loss.item(), clips.size(0))
            if i % 50 == 0 and is_main_process():
                logger.info("epoch %d [%d/%d] loss %.4f (%.4f) lr %.4f %.2fs/it", epoch, i, len(loader),
                            meter.val, meter.avg, self.optimizer.param_groups[0]["lr"],
                            (time.time() - tic) / (i + 1))
        self.scheduler.step()
        return meter.avg

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        all_probs, all_labels, val_loss = [], [], 0.0
        for clips, labels in loader:
            clips = self.normalize(clips.to(self.device, non_blocking=True).float().div_(255.0))
            labels = labels.to(self.device).float()
            with torch.cuda.amp.autocast(enabled=self.cfg.amp):  # expect: AMP009
                logits = self.model(clips)
            probs = torch.sigmoid(logits.float())
            val_loss += F.binary_cross_entropy(probs, labels).item() * clips.size(0)
            all_probs.append(probs.cpu())
            all_labels.append(labels.cpu())
        probs, labels = torch.cat(all_probs), torch.cat(all_labels)
        return val_loss / len(labels), mean_average_precision(probs.numpy(), labels.numpy())

    def save(self, path, epoch, best_map):
        torch.save({
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": epoch,
            "best_map": best_map,
        }, path)

    def resume(self, path):
        ckpt = torch.load(path, map_location=self.device)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.start_epoch = ckpt["epoch"] + 1
        return ckpt.get("best_map", 0.0)

    def export_half(self, path):
        deployable = copy.deepcopy(self.model).eval().half()
        torch.save(deployable.state_dict(), path)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default=Config.data_root)
    p.add_argument("--clip-len", type=int, default=Config.clip_len)
    p.add_argument("--batch-size", type=int, default=Config.batch_size)
    p.add_argument("--epochs", type=int, default=Config.epochs)
    p.add_argument("--lr", type=float, default=Config.lr)
    p.add_argument("--attentive-pool", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default="")
    p.add_argument("--out-dir", default=Config.out_dir)
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = Config(data_root=args.data_root, clip_len=args.clip_len, batch_size=args.batch_size,
                 epochs=args.epochs, lr=args.lr, attentive_pool=args.attentive_pool,
                 amp=args.amp, out_dir=args.out_dir)
    os.makedirs(cfg.out_dir, exist_ok=True)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    train_set = CharadesClips(cfg.data_root, "train", cfg.clip_len, cfg.crop_size)
    val_set = CharadesClips(cfg.data_root, "val", cfg.clip_len, cfg.crop_size)
    train_loader = DataLoader(train_set, cfg.batch_size, shuffle=True, num_workers=10,
                              pin_memory=True, drop_last=True, collate_fn=clip_collate)
    val_loader = DataLoader(val_set, cfg.batch_size, shuffle=False, num_workers=10, collate_fn=clip_collate)

    trainer = Trainer(cfg, device)
    best_map = trainer.resume(args.resume) if args.resume else 0.0
    for epoch in range(trainer.start_epoch, cfg.epochs):
        train_loss = trainer.train_epoch(train_loader, epoch)
        val_loss, val_map = trainer.evaluate(val_loader)
        logger.info("epoch %d train %.4f val %.4f mAP %.2f", epoch, train_loss, val_loss, 100 * val_map)
        trainer.save(os.path.join(cfg.out_dir, "last.pth"), epoch, best_map)
        if val_map > best_map:
            best_map = val_map
            trainer.save(os.path.join(cfg.out_dir, "best.pth"), epoch, best_map)
    trainer.export_half(os.path.join(cfg.out_dir, "model_fp16.pth"))
    logger.info("best mAP %.2f", 100 * best_map)


if __name__ == "__main__":
    main()
