"""Detector training (YOLO-style) with AMP controlled from the experiment config.

    python det_train.py --cfg configs/yolo_s.py --device 0
    python det_train.py --cfg configs/yolo_s.py --device cpu     # smoke test
"""
import argparse
import importlib.util
import logging
import math
import random
import time
from contextlib import nullcontext
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from det.data import create_dataloader
from det.loss import ComputeLoss
from det.models import Detector, build_backbone
from det.utils import ModelEMA, one_cycle, select_device
from det.val import run_validation

LOGGER = logging.getLogger("det")


def load_cfg(path):
    spec = importlib.util.spec_from_file_location("exp_cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Config()


def build_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


def preprocess(batch, device):
    imgs = batch["img"].to(device, non_blocking=True, dtype=torch.float16) / 255.0  # expect: AMP001
    targets = batch["targets"].to(device)
    return imgs, targets


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def train_one_epoch(model, ema, loader, optimizer, scaler, compute_loss, cfg, epoch, device):
    model.train()
    nb = len(loader)
    accumulate = max(round(cfg.nominal_batch_size / cfg.batch_size), 1)
    last_opt_step = -1
    mloss = torch.zeros(3, device=device)
    optimizer.zero_grad()
    for i, batch in enumerate(loader):
        ni = i + nb * epoch
        imgs, targets = preprocess(batch, device)

        if cfg.multi_scale:
            sz = random.randrange(int(cfg.img_size * 0.5), int(cfg.img_size * 1.5) + 32) // 32 * 32
            sf = sz / max(imgs.shape[2:])
            if sf != 1:
                ns = [math.ceil(x * sf / 32) * 32 for x in imgs.shape[2:]]
                imgs = F.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)

        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            pred = model(imgs)
            loss, loss_items = compute_loss(pred, targets)

        scaler.scale(loss).backward()

        if ni - last_opt_step >= accumulate:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if ema is not None:
                ema.update(model)
            last_opt_step = ni

        mloss = (mloss * i + loss_items) / (i + 1)
        if i % 50 == 0:
            mem = torch.cuda.memory_reserved() / 1e9 if torch.cuda.is_available() else 0.0
            LOGGER.info("epoch %d %d/%d mem %.2fG box %.4f obj %.4f cls %.4f", epoch, i, nb, mem, *mloss.tolist())
    return mloss


def finetune_heads(model, loader, optimizer, scaler, compute_loss, cfg, device, epochs=3):
    """Short second stage: backbone frozen, only the detection heads adapt."""
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    model.train()
    for epoch in range(epochs):
        for batch in loader:
            imgs = batch["img"].to(device, non_blocking=True).float() / 255.0
            targets = batch["targets"].to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                loss, _ = compute_loss(model(imgs), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # expect: AMP006
        LOGGER.info("head finetune epoch %d loss %.4f", epoch, loss.item())


def pretrain_backbone_on_crops(backbone, loader, device, epochs=5, lr=0.01):
    """Warm up the backbone as a crop classifier before detection training."""
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(backbone.out_channels, loader.dataset.num_classes))
    net = nn.Sequential(backbone, head).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    ctx = nullcontext() if device.type == "cpu" else torch.autocast(device_type="cuda", dtype=torch.float16)  # expect: AMP010
    net.train()
    for epoch in range(epochs):
        correct = total = 0
        for crops, labels in loader:
            crops, labels = crops.to(device, non_blocking=True), labels.to(device)
            with ctx:
                logits = net(crops)
                loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            correct += (logits.argmax(1) == labels).sum().item()
            total += labels.numel()
        LOGGER.info("crop pretrain epoch %d acc %.3f", epoch, correct / max(total, 1))
    return backbone


def train_mask_head(model, loader, optimizer, cfg, device):
    """Optional instance-mask branch, trained on top of a frozen detector."""
    scaler = torch.amp.GradScaler("cuda") if cfg.amp else None  # expect: AMP010
    model.train()
    for batch in loader:
        imgs = batch["img"].to(device, non_blocking=True).float() / 255.0
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.amp):
            out = model(imgs, with_masks=True)
            loss = F.binary_cross_entropy_with_logits(out["mask_logits"], batch["masks"].to(device))
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()


def save_checkpoint(path, model, ema, optimizer, scaler, epoch, best_fitness):
    ckpt = {
        "epoch": epoch,
        "best_fitness": best_fitness,
        "model": deepcopy(model).half().state_dict(),
        "ema": deepcopy(ema.ema).half().state_dict() if ema is not None else None,
        "updates": ema.updates if ema is not None else 0,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
    }
    torch.save(ckpt, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--device", default="0")
    parser.add_argument("--save-dir", default="runs/det")
    opt = parser.parse_args()

    logging.basicConfig(level=logging.INFO)
    cfg = load_cfg(opt.cfg)
    device = select_device(opt.device)
    cfg.amp = cfg.amp and device.type != "cpu"
    seed_everything(cfg.seed)
    save_dir = Path(opt.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)

    train_loader = create_dataloader(cfg.train_path, cfg.img_size, cfg.batch_size, augment=True)
    val_loader = create_dataloader(cfg.val_path, cfg.img_size, cfg.batch_size * 2, augment=False)

    backbone = build_backbone(cfg)
    if cfg.crop_pretrain_path:
        crop_loader = create_dataloader(cfg.crop_pretrain_path, 224, 128, augment=True, classification=True)
        backbone = pretrain_backbone_on_crops(backbone, crop_loader, device)
    model = Detector(backbone, num_classes=cfg.num_classes).to(device)
    ema = ModelEMA(model)

    g_bn, g_w, g_b = [], [], []
    for m in model.modules():
        if hasattr(m, "bias") and isinstance(m.bias, nn.Parameter):
            g_b.append(m.bias)
        if isinstance(m, nn.BatchNorm2d):
            g_bn.append(m.weight)
        elif hasattr(m, "weight") and isinstance(m.weight, nn.Parameter):
            g_w.append(m.weight)
    optimizer = torch.optim.SGD(g_bn, lr=cfg.lr0, momentum=cfg.momentum, nesterov=True)
    optimizer.add_param_group({"params": g_w, "weight_decay": cfg.weight_decay})
    optimizer.add_param_group({"params": g_b})
    lf = one_cycle(1, cfg.lrf, cfg.epochs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    scaler = build_scaler(cfg.amp)
    compute_loss = ComputeLoss(model, cfg.hyp)

    best_fitness = 0.0
    for epoch in range(cfg.epochs):
        train_one_epoch(model, ema, train_loader, optimizer, scaler, compute_loss, cfg, epoch, device)
        scheduler.step()
        results = run_validation(model=deepcopy(ema.ema).half(), dataloader=val_loader, compute_loss=compute_loss)
        fitness = 0.1 * results["map50"] + 0.9 * results["map"]
        if fitness > best_fitness:
            best_fitness = fitness
            save_checkpoint(save_dir / "best.pt", model, ema, optimizer, scaler, epoch, best_fitness)
        save_checkpoint(save_dir / "last.pt", model, ema, optimizer, scaler, epoch, best_fitness)

    if cfg.head_finetune_epochs > 0:
        head_params = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
        head_opt = torch.optim.SGD(head_params, lr=cfg.lr0 * 0.1, momentum=cfg.momentum)
        head_scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)  # expect: AMP009
        finetune_heads(model, train_loader, head_opt, head_scaler, compute_loss, cfg, device,
                       epochs=cfg.head_finetune_epochs)

    if cfg.train_masks:
        mask_opt = torch.optim.AdamW(model.mask_head.parameters(), lr=1e-4)
        train_mask_head(model, train_loader, mask_opt, cfg, device)


if __name__ == "__main__":
    main()
