"""Train a PatchTST forecaster on multivariate series (ETT, Weather, Electricity).

    python b32_patchtst_train.py --config configs/etth1_336_96.yaml --amp --amp-dtype float16

The backbone comes from ``tsf.models``; this script adds reversible instance
normalisation, the optimisation loop with gradient accumulation, validation,
early stopping and checkpointing.
"""
import argparse
import copy
import json
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader

from tsf.data import build_datasets
from tsf.models import build_forecaster
from tsf.utils import AverageMeter, set_seed

AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def get_args():
    parser = argparse.ArgumentParser(description="PatchTST training")
    parser.add_argument("--config", required=True)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--amp-dtype", default="float16", choices=sorted(AMP_DTYPES))
    parser.add_argument("--fp16-weights", action="store_true", help="store weights in fp16 (large channel counts)")
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--patience", type=int, default=10)
    parser.add_argument("--resume", default="")
    parser.add_argument("--find-lr", action="store_true")
    parser.add_argument("--output", default="runs/patchtst")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    return args, cfg


class RevIN(nn.Module):
    """Reversible instance normalisation (Kim et al., ICLR 2022)."""

    def __init__(self, num_features, eps=1e-5, affine=True):
        super().__init__()
        self.eps, self.affine = eps, affine
        if affine:
            self.affine_weight = nn.Parameter(torch.ones(num_features))
            self.affine_bias = nn.Parameter(torch.zeros(num_features))

    def normalize(self, x):
        self.mean = x.mean(dim=1, keepdim=True).detach()
        self.stdev = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        x = (x - self.mean) / self.stdev
        return x * self.affine_weight + self.affine_bias if self.affine else x

    def denormalize(self, x):
        if self.affine:
            x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class Forecaster(nn.Module):
    def __init__(self, backbone, num_features):
        super().__init__()
        self.revin = RevIN(num_features)
        self.backbone = backbone

    def forward(self, x):
        return self.revin.denormalize(self.backbone(self.revin.normalize(x)))


def train_one_epoch(model, loader, criterion, optimizer, scaler, amp_ctx, args, epoch):
    model.train()
    meter = AverageMeter()
    optimizer.zero_grad(set_to_none=True)
    start = time.time()
    for i, (x, y) in enumerate(loader):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with amp_ctx:
            pred = model(x)
            loss = criterion(pred, y) / args.accum_steps
        scaler.scale(loss).backward()
        if (i + 1) % args.accum_steps == 0:
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        meter.update(loss.item() * args.accum_steps, x.size(0))
    print(f"epoch {epoch}: train loss {meter.avg:.4f} ({time.time() - start:.0f}s)")
    return meter.avg


@torch.no_grad()
def evaluate(model, loader, amp_ctx):
    model.eval()
    mse_sum, mae_sum, n = 0.0, 0.0, 0
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with amp_ctx:
            pred = model(x)
        pred = pred.float()
        mse_sum += F.mse_loss(pred, y, reduction="sum").item()
        mae_sum += (pred - y).abs().sum().item()
        n += y.numel()
    return mse_sum / n, mae_sum / n


def lr_range_test(model, loader, criterion, args, start_lr=1e-7, end_lr=1.0, num_iter=100):
    """Leslie Smith's LR range test; the model is restored afterwards."""
    state = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=start_lr, momentum=0.9)
    gamma = (end_lr / start_lr) ** (1.0 / num_iter)
    lrs, losses, smoothed = [], [], None
    batches = iter(loader)
    for step in range(num_iter):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        x, y = x.cuda(), y.cuda()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=AMP_DTYPES[args.amp_dtype]):
            loss = criterion(model(x), y)
            loss.backward()  # expect: AMP008
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
        lrs.append(optimizer.param_groups[0]["lr"])
        losses.append(smoothed)
        if step > 10 and smoothed > 4 * min(losses):
            break
        for group in optimizer.param_groups:
            group["lr"] *= gamma
    model.load_state_dict(state)
    return lrs, losses


def export_half(model, path):
    """Compact fp16 copy of the best model for the serving container."""
    torch.save(copy.deepcopy(model).half().state_dict(), path)


def save_checkpoint(path, model, optimizer, scaler, scheduler, epoch, best_val):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "best_val": best_val}, path)


def main():
    args, cfg = get_args()
    set_seed(cfg.get("seed", 2021))
    os.makedirs(args.output, exist_ok=True)
    train_set, val_set, test_set = build_datasets(cfg["data"])
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg["batch_size"], num_workers=4)
    test_loader = DataLoader(test_set, batch_size=cfg["batch_size"], num_workers=4)

    model = Forecaster(build_forecaster(cfg["model"]), num_features=cfg["data"]["enc_in"]).cuda()
    if args.fp16_weights:
        model = model.half()
    criterion = nn.MSELoss() if cfg.get("loss", "mse") == "mse" else nn.HuberLoss(delta=1.0)

    if args.find_lr:
        lrs, losses = lr_range_test(model, train_loader, criterion, args)
        best = lrs[int(np.argmin(losses))]
        print(f"suggested lr ~ {best / 10:.2e}")
        return

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"])  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], epochs=cfg["epochs"],
                                                    steps_per_epoch=len(train_loader) // args.accum_steps + 1,
                                                    pct_start=0.3)
    use_fp16_amp = args.amp and args.amp_dtype == "float16"
    try:
        scaler = torch.amp.GradScaler("cuda", enabled=use_fp16_amp)
    except (AttributeError, TypeError):  # torch < 2.3
        scaler = torch.cuda.amp.GradScaler(enabled=use_fp16_amp)
    amp_ctx = torch.autocast("cuda", dtype=AMP_DTYPES[args.amp_dtype]) if args.amp else nullcontext()

    start_epoch, best_val, bad_epochs = 0, float("inf"), 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]

    for epoch in range(start_epoch, cfg["epochs"]):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, amp_ctx, args, epoch)
        scheduler.step()
        val_mse, val_mae = evaluate(model, val_loader, amp_ctx)
        print(f"epoch {epoch}: val mse {val_mse:.4f} mae {val_mae:.4f}")
        save_checkpoint(os.path.join(args.output, "last.pt"), model, optimizer, scaler, scheduler, epoch, best_val)
        if val_mse < best_val:
            best_val, bad_epochs = val_mse, 0
            save_checkpoint(os.path.join(args.output, "best.pt"), model, optimizer, scaler, scheduler, epoch, best_val)
            export_half(model, os.path.join(args.output, "best_fp16.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                print("early stopping")
                break

    model.load_state_dict(torch.load(os.path.join(args.output, "best.pt"), map_location="cpu")["model"])
    test_mse, test_mae = evaluate(model, test_loader, amp_ctx)
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump({"test_mse": test_mse, "test_mae": test_mae, "best_val_mse": best_val}, f, indent=2)
    print(f"test mse {test_mse:.4f} mae {test_mae:.4f}")


if __name__ == "__main__":
    main()
