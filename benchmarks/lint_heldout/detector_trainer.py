"""One-stage detector trainer (YOLO-like): warmup, EMA, AMP, gradient accumulation to a nominal batch."""
import math
import time
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch import amp

from detlib.data import create_dataloader
from detlib.loss import ComputeLoss
from detlib.models import Model
from detlib.utils import LOGGER, check_amp, de_parallel, one_cycle


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


class DetectionTrainer:
    def __init__(self, cfg, device="cuda:0"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = Model(cfg.model_yaml, nc=cfg.nc).to(self.device)
        self.amp = check_amp(self.model)
        self.scaler = amp.GradScaler("cuda", enabled=self.amp)
        self.accumulate = max(round(64 / cfg.batch_size), 1)
        g_bn, g_w, g_b = [], [], []
        for module in self.model.modules():
            if hasattr(module, "bias") and isinstance(module.bias, nn.Parameter):
                g_b.append(module.bias)
            if isinstance(module, nn.BatchNorm2d):
                g_bn.append(module.weight)
            elif hasattr(module, "weight") and isinstance(module.weight, nn.Parameter):
                g_w.append(module.weight)
        self.optimizer = torch.optim.SGD(g_bn, lr=cfg.lr0, momentum=cfg.momentum, nesterov=True)
        self.optimizer.add_param_group({"params": g_w, "weight_decay": cfg.weight_decay})
        self.optimizer.add_param_group({"params": g_b})
        self.lf = one_cycle(1, cfg.lrf, cfg.epochs)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=self.lf)
        self.ema = ModelEMA(self.model)
        self.compute_loss = ComputeLoss(self.model)
        self.loader = create_dataloader(cfg.train_path, cfg.imgsz, cfg.batch_size)

    def optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        self.ema.update(self.model)

    def train(self):
        nb = len(self.loader)
        nw = max(round(3 * nb), 100)
        last_opt_step = -1
        for epoch in range(self.cfg.epochs):
            self.model.train()
            mloss = torch.zeros(3, device=self.device)
            t0 = time.time()
            for i, (imgs, targets, paths, _) in enumerate(self.loader):
                ni = i + nb * epoch
                imgs = imgs.to(self.device, non_blocking=True).float() / 255
                if ni <= nw:
                    xi = [0, nw]
                    self.accumulate = max(1, np.interp(ni, xi, [1, 64 / self.cfg.batch_size]).round())
                with torch.autocast("cuda", enabled=self.amp):
                    pred = self.model(imgs)
                    loss, loss_items = self.compute_loss(pred, targets.to(self.device))
                self.scaler.scale(loss).backward()
                if ni - last_opt_step >= self.accumulate:
                    self.optimizer_step()
                    last_opt_step = ni
                mloss = (mloss * i + loss_items) / (i + 1)
            self.scheduler.step()
            LOGGER.info(f"epoch {epoch}: {mloss.tolist()} {time.time() - t0:.0f}s")
            ckpt = {"epoch": epoch, "model": deepcopy(de_parallel(self.model)).half(), "ema": deepcopy(self.ema.ema).half()}
            torch.save(ckpt, Path(self.cfg.save_dir) / "last.pt")
