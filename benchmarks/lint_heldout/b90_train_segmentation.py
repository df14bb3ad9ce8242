"""Semantic segmentation (DeepLabV3 + auxiliary head) with learned task weighting.

Runs on A100/H100 in bfloat16 autocast.

    python train_segmentation.py --data-root /data/cityscapes --epochs 200
"""
import argparse
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torchvision.models.segmentation import deeplabv3_resnet50

from datasets.cityscapes import CityscapesSegmentation  # project-local


@dataclass
class TrainConfig:
    data_root: str = "/data/cityscapes"
    num_classes: int = 19
    ignore_index: int = 255
    crop_size: int = 768
    batch_size: int = 8
    epochs: int = 200
    lr: float = 0.01
    weight_lr: float = 1e-3
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    workers: int = 8
    log_every: int = 50
    out_dir: str = "runs/deeplab"


class UncertaintyWeighting(nn.Module):
    """Homoscedastic task weighting (Kendall et al., 2018)."""

    def __init__(self, num_tasks):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(num_tasks))

    def forward(self, losses):
        total = 0.0
        for i, task_loss in enumerate(losses):
            total = total + torch.exp(-self.log_vars[i]) * task_loss + self.log_vars[i]
        return total


def build_model(cfg):
    model = deeplabv3_resnet50(weights=None, weights_backbone="DEFAULT",
                               num_classes=cfg.num_classes, aux_loss=True)
    return model


def poly_lr(optimizer, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


@torch.no_grad()
def evaluate(model, loader, device, num_classes, ignore_index):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for images, masks in loader:
        images = images.to(device, dtype=torch.bfloat16, memory_format=torch.channels_last)
        masks = masks.to(device)
        preds = model(images)["out"].argmax(1)
        keep = masks != ignore_index
        hist += torch.bincount(num_classes * masks[keep] + preds[keep],
                               minlength=num_classes ** 2).view(num_classes, num_classes)
    model.train()
    hist = hist.double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())
    return iou.nanmean().item()


def train(cfg: TrainConfig):
    device = torch.device("cuda")
    os.makedirs(cfg.out_dir, exist_ok=True)

    train_set = CityscapesSegmentation(cfg.data_root, split="train", crop_size=cfg.crop_size)
    val_set = CityscapesSegmentation(cfg.data_root, split="val")
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, num_workers=cfg.workers)

    model = build_model(cfg)
    model = model.to(device, dtype=torch.bfloat16, memory_format=torch.channels_last)  # expect: AMP001
    weighting = UncertaintyWeighting(num_tasks=2).to(device)
    criterion = nn.CrossEntropyLoss(ignore_index=cfg.ignore_index)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9,
                                weight_decay=cfg.weight_decay)
    weight_optimizer = torch.optim.Adam(weighting.parameters(), lr=cfg.weight_lr)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    max_it = cfg.epochs * len(train_loader)
    it, best_miou = 0, 0.0
    for epoch in range(cfg.epochs):
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True, dtype=torch.bfloat16) if v.is_floating_point() else v.to(device, non_blocking=True) for k, v in batch.items()}  # expect: AMP001
            lr = poly_lr(optimizer, cfg.lr, it, max_it)

            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                out = model(batch["image"].contiguous(memory_format=torch.channels_last))
            loss = weighting([criterion(out["out"], batch["mask"]), criterion(out["aux"], batch["mask"])])  # expect: AMP002

            optimizer.zero_grad(set_to_none=True)
            weight_optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            scaler.step(optimizer)
            weight_optimizer.step()  # expect: AMP006
            scaler.update()

            if it % cfg.log_every == 0:
                w = torch.exp(-weighting.log_vars.detach()).tolist()
                print(f"ep {epoch} it {it} loss {loss.item():.4f} gnorm {grad_norm.item():.2f} "
                      f"lr {lr:.5f} w_main {w[0]:.3f} w_aux {w[1]:.3f}")
            it += 1

        miou = evaluate(model, val_loader, device, cfg.num_classes, cfg.ignore_index)
        print(f"epoch {epoch} mIoU {miou:.4f} ({time.time() - t0:.0f}s)")
        state = {
            "model": model.state_dict(), "weighting": weighting.state_dict(),
            "optimizer": optimizer.state_dict(), "weight_optimizer": weight_optimizer.state_dict(),
            "scaler": scaler.state_dict(), "epoch": epoch, "config": asdict(cfg),
        }
        torch.save(state, os.path.join(cfg.out_dir, "last.pt"))
        if miou > best_miou:
            best_miou = miou
            torch.save(state, os.path.join(cfg.out_dir, "best.pt"))


def parse_args() -> TrainConfig:
    cfg = TrainConfig()
    p = argparse.ArgumentParser()
    for name, value in asdict(cfg).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return TrainConfig(**vars(p.parse_args()))


if __name__ == "__main__":
    train(parse_args())
