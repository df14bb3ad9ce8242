"""YOLO-style single-stage detector trainer with a model EMA, warmup and mosaic batches (yolov5 train.py flavour)."""
import math
import time
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.cuda import amp
from torch.optim import SGD, lr_scheduler


def de_parallel(model):
    return model.module if hasattr(model, "module") else model


class ModelEMA:
    """Keeps a moving average of everything in the model state_dict (parameters and buffers)."""

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


class ComputeLoss:
    def __init__(self, model, autobalance=False):
        h = model.hyp
        self.BCEcls = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["cls_pw"]]))
        self.BCEobj = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["obj_pw"]]))
        self.balance = [4.0, 1.0, 0.4]
        self.hyp = h

    def __call__(self, p, targets):
        device = targets.device
        lcls = torch.zeros(1, device=device)
        lbox = torch.zeros(1, device=device)
        lobj = torch.zeros(1, device=device)
        for i, pi in enumerate(p):
            tobj = torch.zeros(pi.shape[:4], dtype=pi.dtype, device=device)
            lobj += self.BCEobj(pi[..., 4], tobj) * self.balance[i]
            if targets.shape[0]:
                pcls = pi[..., 5:].flatten(0, 3)[: targets.shape[0]]
                t = torch.full_like(pcls, 0.0)
                lcls += self.BCEcls(pcls, t)
        bs = p[0].shape[0]
        return (lbox + lobj + lcls) * bs, torch.cat((lbox, lobj, lcls)).detach()


def smart_optimizer(model, lr=0.01, momentum=0.937, decay=5e-4):
    g = [], [], []
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=False):
            if p_name == "bias":
                g[2].append(p)
            elif isinstance(v, bn):
                g[1].append(p)
            else:
                g[0].append(p)
    optimizer = SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    return optimizer


@torch.no_grad()
def validate(model, dataloader, half=True, device="cuda"):
    model.eval()
    model = model.half() if half else model.float()
    stats = []
    for im, targets, paths, shapes in dataloader:
        im = im.to(device, non_blocking=True)
        im = im.half() if half else im.float()
        im /= 255
        preds = model(im)[0]
        stats.append(preds[..., 4].sigmoid().mean().item())
    model.float()
    return float(np.mean(stats)) if stats else 0.0


def save_checkpoint(epoch, ema, optimizer, path):
    ckpt = {
        "epoch": epoch,
        "ema": deepcopy(ema.ema).half(),
        "updates": ema.updates,
        "optimizer": optimizer.state_dict(),
    }
    torch.save(ckpt, path)


def train(hyp, opt, model, train_loader, val_loader, device):
    cuda = device.type != "cpu"
    epochs, nb = opt.epochs, len(train_loader)
    nbs = 64
    accumulate = max(round(nbs / opt.batch_size), 1)
    optimizer = smart_optimizer(model, hyp["lr0"], hyp["momentum"], hyp["weight_decay"])
    lf = lambda x: (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)
    scaler = amp.GradScaler(enabled=cuda)  # expect: AMP009
    compute_loss = ComputeLoss(model)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    best_fitness = 0.0
    t0 = time.time()

    for epoch in range(epochs):
        model.train()
        mloss = torch.zeros(3, device=device)
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).half() / 255  # expect: AMP001

            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / opt.batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])

            with amp.autocast(enabled=cuda):  # expect: AMP009
                pred = model(imgs)
            loss, loss_items = compute_loss(pred, targets.to(device))  # expect: AMP002

            scaler.scale(loss).backward()

            if ni - last_opt_step >= accumulate:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                ema.update(model)
                last_opt_step = ni

            mloss = (mloss * i + loss_items) / (i + 1)

        scheduler.step()
        fitness = validate(deepcopy(ema.ema), val_loader, half=cuda, device=device)
        if fitness > best_fitness:
            best_fitness = fitness
            save_checkpoint(epoch, ema, optimizer, Path(opt.save_dir) / "best.pt")
    print(f"{epochs} epochs completed in {(time.time() - t0) / 3600:.3f} hours.")
    return best_fitness
