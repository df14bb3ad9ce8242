"""Object detector training loop (YOLOv5 style), trimmed to the AMP-relevant parts."""
import math
import random
import time
from copy import deepcopy
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.optim import lr_scheduler


def de_parallel(model):
    return model.module if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else model


class ModelEMA:
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
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def smart_optimizer(model, name="Adam", lr=0.001, momentum=0.9, decay=1e-5):
    g = [], [], []
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=0):
            if p_name == "bias":
                g[2].append(p)
            elif p_name == "weight" and isinstance(v, bn):
                g[1].append(p)
            else:
                g[0].append(p)
    if name == "Adam":
        optimizer = torch.optim.Adam(g[2], lr=lr, betas=(momentum, 0.999))
    else:
        optimizer = torch.optim.SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    return optimizer


def train(hyp, opt, device, model, train_loader, compute_loss):
    epochs, batch_size = opt.epochs, opt.batch_size
    amp = device.type != "cpu"
    nbs = 64
    accumulate = max(round(nbs / batch_size), 1)
    optimizer = smart_optimizer(model, opt.optimizer, hyp["lr0"], hyp["momentum"], hyp["weight_decay"])
    lf = lambda x: (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]  # noqa: E731
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)
    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    scaler = torch.cuda.amp.GradScaler(enabled=amp)  # expect: AMP009
    best_fitness = 0.0
    for epoch in range(epochs):
        model.train()
        mloss = torch.zeros(3, device=device)
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255
            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
            if opt.multi_scale:
                sz = random.randrange(int(640 * 0.5), int(640 * 1.5) + 32) // 32 * 32
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
                if ema:
                    ema.update(model)
                last_opt_step = ni
            mloss = (mloss * i + loss_items) / (i + 1)
        scheduler.step()
        ckpt = {
            "epoch": epoch,
            "best_fitness": best_fitness,
            "model": deepcopy(de_parallel(model)).half(),
            "ema": deepcopy(ema.ema).half(),
            "updates": ema.updates,
            "optimizer": optimizer.state_dict(),
            "date": datetime.now().isoformat(),
        }
        torch.save(ckpt, Path(opt.save_dir) / "last.pt")
        del ckpt


def strip_optimizer(f="best.pt", s=""):
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


@torch.no_grad()
def run_val(model, dataloader, half=True, compute_loss=None):
    device = next(model.parameters()).device
    half &= device.type != "cpu"
    model.half() if half else model.float()
    model.eval()
    stats = []
    for batch_i, (im, targets, paths, shapes) in enumerate(dataloader):
        im = im.to(device, non_blocking=True)
        im = im.half() if half else im.float()
        im /= 255
        preds, train_out = model(im)
        stats.append(preds)
    model.float()
    return stats
