# YOLO-style detector training, trimmed from the ultralytics layout
"""
Train a YOLO-style detector on a custom dataset.

Usage:
    $ python train_detector.py --data coco128.yaml --weights yolov5s.pt --img 640
"""

import argparse
import math
import os
import time
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.optim import lr_scheduler
from tqdm import tqdm

from models.yolo import Model
from utils.dataloaders import create_dataloader
from utils.loss import ComputeLoss
from utils.general import LOGGER, check_dataset, colorstr, labels_to_class_weights


def de_parallel(model):
    return model.module if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else model


class ModelEMA:
    """Exponential moving average of model weights."""

    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = de_parallel(model).state_dict()
        with torch.no_grad():
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1 - d) * msd[k].detach()


def check_amp(model):
    device = next(model.parameters()).device
    if device.type in ("cpu", "mps"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 7


@torch.no_grad()
def run_val(model, dataloader, compute_loss, half=True):
    device = next(model.parameters()).device
    model.half() if half else model.float()
    model.eval()
    loss = torch.zeros(3, device=device)
    for im, targets, paths, shapes in dataloader:
        im = im.to(device, non_blocking=True)
        targets = targets.to(device)
        im = im.half() if half else im.float()
        im /= 255
        preds, train_out = model(im)
        loss += compute_loss(train_out, targets)[1]
    model.float()
    return (loss.cpu() / len(dataloader)).tolist()


def strip_optimizer(f="best.pt"):
    x = torch.load(f, map_location=torch.device("cpu"))
    if x.get("ema"):
        x["model"] = x["ema"]
    for k in "optimizer", "best_fitness", "ema", "updates":
        x[k] = None
    x["epoch"] = -1
    x["model"].half()
    for p in x["model"].parameters():
        p.requires_grad = False
    torch.save(x, f)


def train(hyp, opt, device):
    save_dir, epochs, batch_size = Path(opt.save_dir), opt.epochs, opt.batch_size
    w = save_dir / "weights"
    w.mkdir(parents=True, exist_ok=True)
    last, best = w / "last.pt", w / "best.pt"

    data_dict = check_dataset(opt.data)
    nc = int(data_dict["nc"])
    model = Model(opt.cfg, ch=3, nc=nc, anchors=hyp.get("anchors")).to(device)
    amp = check_amp(model)

    nbs = 64
    accumulate = max(round(nbs / batch_size), 1)
    hyp["weight_decay"] *= batch_size * accumulate / nbs
    optimizer = torch.optim.SGD(model.parameters(), lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True)
    lf = lambda x: (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)

    train_loader, dataset = create_dataloader(data_dict["train"], opt.imgsz, batch_size, 32, hyp=hyp,
                                              augment=True, prefix=colorstr("train: "))
    val_loader = create_dataloader(data_dict["val"], opt.imgsz, batch_size * 2, 32, rect=True)[0]
    model.class_weights = labels_to_class_weights(dataset.labels, nc).to(device) * nc

    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    best_fitness = 0.0
    scaler = torch.cuda.amp.GradScaler(enabled=amp)  # expect: AMP009
    compute_loss = ComputeLoss(model)
    t0 = time.time()

    for epoch in range(epochs):
        model.train()
        mloss = torch.zeros(3, device=device)
        pbar = tqdm(enumerate(train_loader), total=nb)
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in pbar:
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).half() / 255  # expect: AMP001

            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])

            if opt.multi_scale:
                sz = int(np.random.uniform(opt.imgsz * 0.5, opt.imgsz * 1.5 + 32)) // 32 * 32
                sf = sz / max(imgs.shape[2:])
                if sf != 1:
                    ns = [math.ceil(x * sf / 32) * 32 for x in imgs.shape[2:]]
                    imgs = nn.functional.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)

            with torch.cuda.amp.autocast(amp):  # expect: AMP009
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))

            scaler.scale(loss).backward()

            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                ema.update(model)
                last_opt_step = ni

            mloss = (mloss * i + loss_items) / (i + 1)
            mem = f"{torch.cuda.memory_reserved() / 1E9 if torch.cuda.is_available() else 0:.3g}G"
            pbar.set_description(("%11s" * 2 + "%11.4g" * 4) % (f"{epoch}/{epochs - 1}", mem, *mloss, imgs.shape[-1]))

        scheduler.step()
        results = run_val(ema.ema, val_loader, compute_loss, half=amp)
        fi = -sum(results)
        if fi > best_fitness:
            best_fitness = fi

        ckpt = {
            "epoch": epoch,
            "best_fitness": best_fitness,
            "model": deepcopy(de_parallel(model)).half(),
            "ema": deepcopy(ema.ema).half(),
            "updates": ema.updates,
            "optimizer": optimizer.state_dict(),
            "opt": vars(opt),
        }
        torch.save(ckpt, last)
        if best_fitness == fi:
            torch.save(ckpt, best)
        del ckpt

    LOGGER.info(f"\n{epochs} epochs completed in {(time.time() - t0) / 3600:.3f} hours.")
    for f in last, best:
        if f.exists():
            strip_optimizer(f)


def parse_opt():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", type=str, default="models/yolov5s.yaml")
    parser.add_argument("--data", type=str, default="data/coco128.yaml")
    parser.add_argument("--hyp", type=str, default="data/hyps/hyp.scratch-low.yaml")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--imgsz", "--img", type=int, default=640)
    parser.add_argument("--multi-scale", action="store_true")
    parser.add_argument("--save-dir", type=str, default="runs/train/exp")
    parser.add_argument("--device", default="cuda:0")
    return parser.parse_args()


if __name__ == "__main__":
    import yaml

    opt = parse_opt()
    with open(opt.hyp, errors="ignore") as f:
        hyp = yaml.safe_load(f)
    train(hyp, opt, torch.device(opt.device))
