"""Multi-task dense prediction (NYUv2: segmentation, depth, surface normals).

Task weighting: homoscedastic uncertainty (Kendall, Gal & Cipolla, 2018) learned with
its own optimizer, or fixed weights from the config as a baseline.  Afterwards each
task head can be refined on frozen shared features.
"""
import argparse
import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from mtl.data import build_nyuv2
from mtl.models import build_multitask_model

TASKS = ("seg", "depth", "normal")


class UncertaintyWeighting(nn.Module):
    """L = sum_i exp(-s_i) * L_i + s_i with s_i = log(sigma_i^2), one s_i per task."""

    def __init__(self, tasks):
        super().__init__()
        self.tasks = list(tasks)
        self.log_vars = nn.Parameter(torch.zeros(len(self.tasks)))

    def forward(self, losses):
        total = 0.0
        for i, name in enumerate(self.tasks):
            inv_var = torch.exp(-self.log_vars[i])
            total = total + inv_var * losses[name] + self.log_vars[i]
        return total

    def sigmas(self):
        return {t: float(torch.exp(0.5 * lv)) for t, lv in zip(self.tasks, self.log_vars.detach())}


class MultiTaskTrainer:
    def __init__(self, model, cfg, device):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.weighting = UncertaintyWeighting(TASKS).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"], momentum=0.9,
                                         weight_decay=cfg["wd"], nesterov=True)
        self.weight_optimizer = torch.optim.Adam(self.weighting.parameters(), lr=cfg["weight_lr"])
        self.scaler = torch.amp.GradScaler("cuda")
        self.criteria = {
            "seg": nn.CrossEntropyLoss(ignore_index=255),
            "depth": nn.L1Loss(),
            "normal": nn.L1Loss(),
        }

    def train_step(self, batch):
        images = batch["image"].to(self.device, non_blocking=True)
        targets = {t: batch[t].to(self.device, non_blocking=True) for t in TASKS}
        with torch.autocast("cuda", dtype=torch.float16):
            preds = self.model(images)
            losses = {t: self.criteria[t](preds[t], targets[t]) for t in TASKS}
            total = self.weighting(losses)

        self.optimizer.zero_grad(set_to_none=True)
        self.weight_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["clip"])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.weight_optimizer.step()  # expect: AMP006

        logs = {t: loss.item() for t, loss in losses.items()}
        logs.update(total=total.item(), grad_norm=grad_norm.item())
        return logs

    def fit(self, loader, epochs):
        for epoch in range(epochs):
            self.model.train()
            for i, batch in enumerate(loader):
                logs = self.train_step(batch)
                if i % 50 == 0:
                    print(epoch, i, logs, self.weighting.sigmas())


def train_epoch_fixed(model, loader, optimizer, scaler, weights, clip, device):
    """Baseline: fixed task weights from the config."""
    seg_criterion = nn.CrossEntropyLoss(ignore_index=255)
    model.train()
    for step, batch in enumerate(loader):
        images = batch["image"].to(device, non_blocking=True)
        seg_gt = batch["seg"].to(device, non_blocking=True)
        depth_gt = batch["depth"].to(device, non_blocking=True)
        normal_gt = batch["normal"].to(device, non_blocking=True)
        valid = depth_gt > 0
        with torch.autocast("cuda", dtype=torch.float16):
            preds = model(images)
            seg_loss = seg_criterion(preds["seg"], seg_gt)
            normal_loss = F.l1_loss(preds["normal"], normal_gt)
        # masked depth loss, kept outside autocast "so that it stays in fp32"
        depth_loss = F.l1_loss(preds["depth"][valid], depth_gt[valid])  # expect: AMP002
        loss = weights["seg"] * seg_loss + weights["depth"] * depth_loss + weights["normal"] * normal_loss

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        if step % 50 == 0:
            print(f"step {step} seg {seg_loss.item():.3f} depth {depth_loss.item():.3f} "
                  f"normal {normal_loss.item():.3f}")


def finetune_task_head(model, task, loader, args, device):
    """Refine one task head on frozen shared features; returns the refined copy."""
    model.eval()
    head = copy.deepcopy(model.heads[task]).half()  # expect: AMP001
    head.train()
    optimizer = torch.optim.SGD(head.parameters(), lr=args.head_lr, momentum=0.9)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else contextlib.nullcontext()  # expect: AMP010
    criterion = nn.CrossEntropyLoss(ignore_index=255) if task == "seg" else nn.L1Loss()
    for epoch in range(args.head_epochs):
        for batch in loader:
            images = batch["image"].to(device, non_blocking=True)
            target = batch[task].to(device, non_blocking=True)
            with torch.no_grad():
                feats = model.backbone(images)
            with amp_ctx:
                loss = criterion(head(feats), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"{task} head epoch {epoch}: loss {loss.item():.4f}")
    return head


@torch.no_grad()
def evaluate(model, loader, device, amp=True):
    model.eval()
    inter = torch.zeros(40, device=device)
    union = torch.zeros(40, device=device)
    abs_rel, n_px = 0.0, 0
    for batch in loader:
        images = batch["image"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            preds = model(images.half() if amp else images)
        seg = preds["seg"].argmax(1)
        gt = batch["seg"].to(device)
        for c in range(40):
            p, g = seg == c, gt == c
            inter[c] += (p & g).sum()
            union[c] += (p | g).sum()
        depth = preds["depth"].float().squeeze(1)
        d_gt = batch["depth"].to(device)
        valid = d_gt > 0
        abs_rel += ((depth - d_gt).abs() / d_gt.clamp(min=1e-3))[valid].sum().item()
        n_px += int(valid.sum())
    miou = (inter / union.clamp(min=1)).mean().item()
    return {"mIoU": miou, "abs_rel": abs_rel / max(n_px, 1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/nyuv2_mtl.yaml")
    p.add_argument("--weighting", choices=["uncertainty", "fixed"], default="uncertainty")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--head-epochs", type=int, default=10)
    p.add_argument("--head-lr", type=float, default=1e-3)
    p.add_argument("--amp", action="store_true")
    args = p.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    device = torch.device("cuda")
    train_loader, val_loader = build_nyuv2(cfg["data"])
    model = build_multitask_model(cfg["model"])

    if args.weighting == "uncertainty":
        trainer = MultiTaskTrainer(model, cfg["optim"], device)
        trainer.fit(train_loader, args.epochs)
        model = trainer.model
    else:
        model = model.to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg["optim"]["lr"], momentum=0.9,
                                    weight_decay=cfg["optim"]["wd"])
        scaler = torch.amp.GradScaler("cuda")
        for _ in range(args.epochs):
            train_epoch_fixed(model, train_loader, optimizer, scaler, cfg["weights"], cfg["optim"]["clip"], device)

    print("joint:", evaluate(model, val_loader, device))
    for task in TASKS:
        model.heads[task] = finetune_task_head(model, task, train_loader, args, device)
    print("refined:", evaluate(model, val_loader, device))
    torch.save({k: v.half() for k, v in model.state_dict().items()}, "mtl_final_fp16.pt")


if __name__ == "__main__":
    main()
