"""Detector training loop with EMA and checkpoint tooling (YOLOv5-style).

Checkpoints store fp16 deep copies of the model and its EMA; release tooling strips
optimizer state, averages checkpoints and converts state dicts between precisions.
This file still uses the pre-2.4 AMP entry points in the training loop (the old
torch.cuda.amp.GradScaler / torch.cuda.amp.autocast); see the migration notes.
"""
import math
import time
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn

import val as validate
from models.experimental import attempt_load
from models.yolo import Model
from utils.general import check_amp, de_parallel
from utils.loss import ComputeLoss


class ModelEMA:
    """Updated Exponential Moving Average of the model (kept in fp32, frozen)."""

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


def strip_optimizer(f="best.pt", s=""):
    """Strip optimizer state from a checkpoint and store the model in fp16 for release."""
    x = torch.load(f, map_location=torch.device("cpu"))
    if x.get("ema"):
        x["model"] = x["ema"]
    for k in "optimizer", "best_fitness", "ema", "updates":
        x[k] = None
    x["epoch"] = -1
    x["model"].half()
    for p in x["model"].parameters():
        p.requires_grad = False
    torch.save(x, s or f)
    mb = Path(s or f).stat().st_size / 1e6
    print(f"Optimizer stripped from {f},{f' saved as {s},' if s else ''} {mb:.1f}MB")


def convert_checkpoint(src, dst, precision="fp16"):
    """Convert a checkpoint's state dict to fp16 / bf16 / fp32 for release."""
    ckpt = torch.load(src, map_location="cpu")
    sd = ckpt.get("model", ckpt)
    if isinstance(sd, nn.Module):
        sd = sd.float().state_dict()
    target = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    out = {k: (v.to(target) if v.is_floating_point() else v) for k, v in sd.items()}
    torch.save(out, dst)


def legacy_half_state_dict(path, dst):
    """Old release format: every float tensor as torch.HalfTensor on the CPU."""
    sd = torch.load(path, map_location="cpu")
    sd = {k: v.type(torch.HalfTensor) if v.is_floating_point() else v for k, v in sd.items()}
    torch.save(sd, dst)


def average_checkpoints(paths, out_path):
    avg = None
    for path in paths:
        sd = torch.load(path, map_location="cpu")["model"].float().state_dict()
        if avg is None:
            avg = {k: v.clone() for k, v in sd.items()}
        else:
            for k in avg:
                avg[k] += sd[k]
    for k, v in avg.items():
        if v.is_floating_point():
            v /= len(paths)
    torch.save({"model": {k: v.half() if v.is_floating_point() else v for k, v in avg.items()}}, out_path)


def train(hyp, opt, device, data_dict, train_loader, val_loader, nc):
    save_dir = Path(opt.save_dir)
    last, best = save_dir / "last.pt", save_dir / "best.pt"
    model = Model(opt.cfg, ch=3, nc=nc).to(device)
    if opt.weights:
        ckpt = torch.load(opt.weights, map_location="cpu")
        model.load_state_dict(ckpt["model"].float().state_dict(), strict=False)
    amp = check_amp(model)
    nbs = 64
    accumulate = max(round(nbs / opt.batch_size), 1)
    g = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(g, lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda x: (1 - x / opt.epochs) * 0.99 + 0.01)
    ema = ModelEMA(model)
    scaler = torch.cuda.amp.GradScaler(enabled=amp)  # expect: AMP009
    compute_loss = ComputeLoss(model)
    nb = len(train_loader)
    last_opt_step = -1
    best_fitness = 0.0
    t0 = time.time()

    for epoch in range(opt.epochs):
        model.train()
        mloss = torch.zeros(3, device=device)
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).half() / 255  # expect: AMP001
            with torch.cuda.amp.autocast(amp):  # expect: AMP009
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
            scaler.scale(loss).backward()
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)  # expect: AMP006
                optimizer.zero_grad()
                ema.update(model)
                last_opt_step = ni
            mloss = (mloss * i + loss_items) / (i + 1)
        scheduler.step()

        results, maps, _ = validate.run(
            data_dict,
            batch_size=opt.batch_size * 2,
            imgsz=opt.imgsz,
            half=amp,
            model=ema.ema,
            dataloader=val_loader,
            save_dir=save_dir,
            plots=False,
            compute_loss=compute_loss,
        )
        fitness = 0.1 * results[2] + 0.9 * results[3]
        if fitness > best_fitness:
            best_fitness = fitness
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
        if best_fitness == fitness:
            torch.save(ckpt, best)
        del ckpt

    for f in last, best:
        if f.exists():
            strip_optimizer(f)
            if f is best:
                results, _, _ = validate.run(
                    data_dict,
                    batch_size=opt.batch_size * 2,
                    imgsz=opt.imgsz,
                    model=attempt_load(f, device).half(),
                    iou_thres=0.65,
                    dataloader=val_loader,
                    save_dir=save_dir,
                    verbose=True,
                    compute_loss=compute_loss,
                )
    print(f"{opt.epochs} epochs completed in {(time.time() - t0) / 3600:.3f} hours.")
    return results


@torch.no_grad()
def run_detection(weights, source, device="cuda", half=True, conf_thres=0.25):
    model = attempt_load(weights, device)
    model = model.half() if half else model.float()
    model.eval()
    detections = []
    for path, im in source:
        im = torch.from_numpy(im).to(device)
        im = im.half() if half else im.float()
        im /= 255
        if im.ndim == 3:
            im = im[None]
        pred = model(im)[0]
        detections.append((path, pred[pred[..., 4] > conf_thres]))
    return detections
