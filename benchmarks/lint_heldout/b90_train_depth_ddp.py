"""Monocular depth estimation: DDP training with gradient accumulation and fp16 autocast.

    torchrun --nproc_per_node=4 train_depth_ddp.py --config configs/nyu_resnet50.yaml
"""
import argparse
import math
import os
import time
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from depthnet.data import build_dataset  # project-local
from depthnet.models import build_depth_model  # project-local

amp_ctx = partial(torch.autocast, "cuda", dtype=torch.float16)


def setup_distributed():
    if "RANK" not in os.environ:
        return 0, 1, 0
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return rank, world, local_rank


def load_config(path):
    with open(path) as f:
        raw = yaml.safe_load(f)
    raw.setdefault("accum_steps", 1)
    raw.setdefault("clip_grad", 1.0)
    raw.setdefault("init_scale", 2.0 ** 12)
    raw.setdefault("min_depth", 1e-3)
    raw.setdefault("max_depth", 10.0)
    raw.setdefault("l1_weight", 0.1)
    raw.setdefault("log_every", 20)
    return SimpleNamespace(**raw)


class SILogLoss(nn.Module):
    """Scale-invariant log loss (Eigen et al.), computed in float32."""

    def __init__(self, variance_focus=0.85):
        super().__init__()
        self.variance_focus = variance_focus

    def forward(self, pred, target):
        d = torch.log(pred.float()) - torch.log(target.float())
        return torch.sqrt((d ** 2).mean() - self.variance_focus * d.mean() ** 2) * 10.0


@torch.no_grad()
def validate(model, loader, device, cfg):
    model.eval()
    abs_rel, rmse, n = 0.0, 0.0, 0
    for images, depth in loader:
        images, depth = images.to(device), depth.to(device)
        with amp_ctx():
            pred = model(images)
        pred = F.interpolate(pred.float(), size=depth.shape[-2:], mode="bilinear", align_corners=False)
        valid = (depth > cfg.min_depth) & (depth < cfg.max_depth)
        p, g = pred[valid].clamp(cfg.min_depth, cfg.max_depth), depth[valid]
        abs_rel += ((p - g).abs() / g).mean().item()
        rmse += torch.sqrt(((p - g) ** 2).mean()).item()
        n += 1
    model.train()
    return abs_rel / max(n, 1), rmse / max(n, 1)


def train(cfg):
    rank, world, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    train_set, val_set = build_dataset(cfg, "train"), build_dataset(cfg, "val")
    sampler = DistributedSampler(train_set, shuffle=True) if world > 1 else None
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, shuffle=sampler is None,
                        num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, num_workers=2)

    model = build_depth_model(cfg).to(device)
    if world > 1:
        model = DDP(model, device_ids=[local_rank])
    silog = SILogLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, eps=1e-8)
    steps_per_epoch = len(loader) // cfg.accum_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, pct_start=0.1,
                                                    total_steps=cfg.epochs * steps_per_epoch)
    scaler = torch.amp.GradScaler("cuda", init_scale=cfg.init_scale, growth_interval=2000)

    start_epoch = 0
    if getattr(cfg, "resume", None):
        ckpt = torch.load(cfg.resume, map_location=device)
        (model.module if world > 1 else model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, cfg.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for it, (images, depth) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            depth = depth.to(device, non_blocking=True, dtype=torch.half)  # expect: AMP001

            with amp_ctx():
                pred = model(images)
                pred = F.interpolate(pred, size=depth.shape[-2:], mode="bilinear", align_corners=False)
                valid = (depth > cfg.min_depth) & (depth < cfg.max_depth)
                loss_silog = silog(pred[valid], depth[valid])
            loss = loss_silog + cfg.l1_weight * F.l1_loss(pred[valid], depth[valid])  # expect: AMP002
            loss = loss / cfg.accum_steps

            boundary = (it + 1) % cfg.accum_steps == 0
            sync_ctx = nullcontext if boundary or world == 1 else model.no_sync
            with sync_ctx():
                scaler.scale(loss).backward()
            if not boundary:
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)  # expect: AMP005
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            if is_main and (it // cfg.accum_steps) % cfg.log_every == 0:
                print(f"ep {epoch} it {it} loss {loss.item() * cfg.accum_steps:.4f} "
                      f"gnorm {grad_norm.item():.2f} scale {scaler.get_scale():.0f}")

        if is_main:
            abs_rel, rmse = validate(model, val_loader, device, cfg)
            print(f"epoch {epoch}: abs_rel {abs_rel:.4f} rmse {rmse:.4f} ({time.time() - t0:.0f}s)")
            torch.save({
                "model": (model.module if world > 1 else model).state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch,
            }, os.path.join(cfg.out_dir, "last.pt"))

    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    train(load_config(parser.parse_args().config))
