"""Single-stage detector (YOLO-style) with a Trainer object that owns model, optimizer and scaler."""
import copy
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda import amp


class ConvBNAct(nn.Module):
    def __init__(self, c1, c2, k=3, s=1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class TinyYolo(nn.Module):
    def __init__(self, nc=80, na=3):
        super().__init__()
        self.na, self.no = na, nc + 5
        self.backbone = nn.Sequential(
            ConvBNAct(3, 32, 6, 2), ConvBNAct(32, 64, 3, 2), ConvBNAct(64, 128, 3, 2), ConvBNAct(128, 256, 3, 2)
        )
        self.head = nn.Conv2d(256, na * self.no, 1)

    def forward(self, x):
        p = self.head(self.backbone(x))
        b, _, h, w = p.shape
        return p.view(b, self.na, self.no, h, w).permute(0, 1, 3, 4, 2).contiguous()


class Trainer:
    def __init__(self, model, hyp, device):
        self.device = device
        self.hyp = hyp
        self.model = model.to(device).half()  # expect: AMP001
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True)
        self.scaler = amp.GradScaler()  # expect: AMP009
        self.obj_bce = nn.BCELoss()
        self.cls_bce = nn.BCEWithLogitsLoss()
        self.best_fitness = 0.0
        self.patience, self.bad_epochs = hyp.get("patience", 30), 0

    def train_step(self, imgs, targets):
        imgs = imgs.to(self.device, non_blocking=True).float() / 255.0
        obj_t = targets["obj"].to(self.device)
        cls_t = targets["cls"].to(self.device)
        iou_t = targets["iou"].to(self.device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = self.model(imgs)
            obj_p = torch.sigmoid(pred[..., 4])
            lobj = self.obj_bce(obj_p, obj_t)  # expect: AMP003
            lcls = self.cls_bce(pred[..., 5:], cls_t)
            with torch.autocast("cuda", enabled=False):
                liou = F.binary_cross_entropy(torch.sigmoid(pred[..., 4].float()), iou_t.float())
            loss = lobj * self.hyp["obj"] + lcls * self.hyp["cls"] + liou * self.hyp.get("iou", 0.5)
        loss = self.scaler.scale(loss)
        loss.backward()
        torch.nn.utils.clip_grad_value_(self.model.parameters(), 10.0)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach() / self.scaler.get_scale()

    def validate_epoch(self, loader):
        self.model.eval()
        total = 0.0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for imgs, targets in loader:
                pred = self.model(imgs.to(self.device).float() / 255.0)
                obj_t = targets["obj"].to(self.device)
                total += F.binary_cross_entropy(torch.sigmoid(pred[..., 4]), obj_t).item()  # expect: AMP003
        self.model.train()
        return total / max(len(loader), 1)

    def _all_reduce_flags(self, flags):
        """Pack per-rank stop flags for one all-reduce (NCCL has no bool reduction here)."""
        buf = flags.to(torch.float16)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(buf)
        return buf > 0

    def save(self, path, epoch):
        ckpt = {
            "epoch": epoch,
            "best_fitness": self.best_fitness,
            "model": copy.deepcopy(self.model).half(),
            "optimizer": self.optimizer.state_dict(),
        }
        torch.save(ckpt, path)

    def fit(self, train_loader, val_loader, epochs, save_dir):
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        for epoch in range(epochs):
            self.model.train()
            t0, mloss = time.time(), 0.0
            for i, (imgs, targets) in enumerate(train_loader):
                mloss = (mloss * i + self.train_step(imgs, targets).item()) / (i + 1)
            val_loss = self.validate_epoch(val_loader)
            fitness = 1.0 / (1.0 + val_loss)
            if fitness > self.best_fitness:
                self.best_fitness, self.bad_epochs = fitness, 0
                self.save(save_dir / "best.pt", epoch)
            else:
                self.bad_epochs += 1
            self.save(save_dir / "last.pt", epoch)
            print(f"{epoch}/{epochs - 1} loss {mloss:.4f} val {val_loss:.4f} {time.time() - t0:.1f}s")
            stop = torch.tensor([float(self.bad_epochs >= self.patience)], device=self.device)
            if self._all_reduce_flags(stop).item():
                break


def strip_optimizer(f="best.pt"):
    x = torch.load(f, map_location=torch.device("cpu"))
    x["model"].half()
    for p in x["model"].parameters():
        p.requires_grad = False
    x["optimizer"] = None
    torch.save(x, f)


def attempt_load(path, device="cpu"):
    return torch.load(path, map_location=device)["model"].float().eval()


def validate(model, loader, device, conf_thres=0.5):
    model.to(device).eval()
    seen, hits = 0, 0
    with torch.no_grad():
        for imgs, targets in loader:
            imgs = imgs.to(device).half() / 255.0
            conf = model(imgs)[..., 4].sigmoid()
            hits += int(((conf > conf_thres) == targets["obj"].to(device).bool()).sum())
            seen += conf.numel()
    return hits / max(seen, 1)


@torch.no_grad()
def run_inference(weights, frames, device="cuda", half=True):
    model = attempt_load(weights, device)
    if half:
        model.half()
    detections = []
    for frame in frames:
        im = torch.from_numpy(np.ascontiguousarray(frame.transpose(2, 0, 1))).to(device)
        im = im.half() if half else im.float()
        im /= 255
        pred = model(im[None])
        detections.append(pred[pred[..., 4].sigmoid() > 0.25])
    return detections


def main(train_loader, val_loader, hyp, epochs=100, save_dir="runs/train/exp"):
    device = torch.device("cuda:0")
    trainer = Trainer(TinyYolo(nc=hyp["nc"]), hyp, device)
    trainer.fit(train_loader, val_loader, epochs, save_dir)
    best = Path(save_dir) / "best.pt"
    strip_optimizer(best)
    return validate(model=attempt_load(best).half(), loader=val_loader, device=device)
