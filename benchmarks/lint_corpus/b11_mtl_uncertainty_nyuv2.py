"""Multi-task dense prediction on NYUv2 (seg-13, depth, surface normals, edges).

Shared ResNet-50 dilated backbone + per-task ASPP-lite decoders + a light cross-task
attention block. Loss weighting: homoscedastic uncertainty (Kendall et al. 2018).

trainer.py in our repo -- model.py/losses.py pasted in so the experiment is self contained.
"""
import copy
import json
import logging
import math
import os
import time
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.utils import clip_grad_norm_
from torch.utils.data import DataLoader

from datasets.nyuv2 import NYUv2  # noqa  (our loader: image, seg, depth, normal, edge, valid)

log = logging.getLogger(__name__)

TASKS = ["seg", "depth", "normal", "edge"]
NUM_SEG_CLASSES = 13


# =====================================================================================
# model
# =====================================================================================
class ConvBNReLU(nn.Sequential):
    def __init__(self, cin, cout, k=3, d=1):
        super().__init__(
            nn.Conv2d(cin, cout, k, padding=d * (k // 2), dilation=d, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


class ASPPLite(nn.Module):
    def __init__(self, cin, cout, rates=(1, 6, 12)):
        super().__init__()
        self.branches = nn.ModuleList([ConvBNReLU(cin, cout, 1 if r == 1 else 3, r) for r in rates])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1), nn.ReLU(inplace=True))
        self.proj = ConvBNReLU(cout * (len(rates) + 1), cout, 1)

    def forward(self, x):
        h, w = x.shape[-2:]
        outs = [b(x) for b in self.branches]
        outs.append(F.interpolate(self.pool(x), size=(h, w), mode="bilinear", align_corners=False))
        return self.proj(torch.cat(outs, 1))


class CrossTaskAttention(nn.Module):
    """each task queries the other tasks' features at 1/4 resolution (multi-modal distillation-ish)"""

    def __init__(self, dim, n_tasks):
        super().__init__()
        self.q = nn.Conv2d(dim, dim // 4, 1)
        self.k = nn.Conv2d(dim, dim // 4, 1)
        self.v = nn.Conv2d(dim, dim, 1)
        self.gamma = nn.Parameter(torch.zeros(n_tasks))

    def forward(self, feats, valid=None):
        # feats: list of (B, C, H, W) per task; valid: (B, H*W) bool, False on the black border
        out = []
        B, C, H, W = feats[0].shape
        for t, f in enumerate(feats):
            q = self.q(f).flatten(2).transpose(1, 2)                    # (B, HW, C/4)
            others = sum(g for s, g in enumerate(feats) if s != t) / (len(feats) - 1)
            k = self.k(others).flatten(2)                               # (B, C/4, HW)
            v = self.v(others).flatten(2).transpose(1, 2)              # (B, HW, C)
            attn = torch.bmm(q, k) / math.sqrt(k.shape[1])
            if valid is not None:
                attn = attn.masked_fill(~valid[:, None, :], torch.finfo(attn.dtype).min)
            attn = attn.softmax(-1)
            ctx = torch.bmm(attn, v).transpose(1, 2).reshape(B, C, H, W)
            out.append(f + self.gamma[t] * ctx)
        return out


class MTLNet(nn.Module):
    def __init__(self, pretrained=True, dim=256, class_mask=None):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2" if pretrained else None,
                                          replace_stride_with_dilation=[False, True, True])
        self.stem = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = r50.layer1, r50.layer2, r50.layer3, r50.layer4
        self.decoders = nn.ModuleDict({t: ASPPLite(2048, dim) for t in TASKS})
        self.low = nn.ModuleDict({t: ConvBNReLU(256, 48, 1) for t in TASKS})
        self.fuse = nn.ModuleDict({t: ConvBNReLU(dim + 48, dim) for t in TASKS})
        self.xtask = CrossTaskAttention(dim, len(TASKS))
        self.heads = nn.ModuleDict({
            "seg": nn.Conv2d(dim, NUM_SEG_CLASSES, 1),
            "depth": nn.Sequential(nn.Conv2d(dim, 1, 1), nn.ReLU()),
            "normal": nn.Conv2d(dim, 3, 1),
            "edge": nn.Sequential(nn.Conv2d(dim, 1, 1), nn.Sigmoid()),
        })
        self.valid_head = nn.Conv2d(dim, 1, 1)  # predicts the valid-depth mask (logits)
        # some of our splits use a subset of the 13 classes
        self.register_buffer("class_mask", class_mask if class_mask is not None else None)

    def _mask_classes(self, logits):
        if self.class_mask is None:
            return logits
        return logits.masked_fill(~self.class_mask.view(1, -1, 1, 1), -1e9)  # expect: AMP007

    def forward(self, x, valid=None):
        H, W = x.shape[-2:]
        x = self.stem(x)
        c1 = self.layer1(x)
        c4 = self.layer4(self.layer3(self.layer2(c1)))
        feats = []
        for t in TASKS:
            d = self.decoders[t](c4)
            d = F.interpolate(d, size=c1.shape[-2:], mode="bilinear", align_corners=False)
            feats.append(self.fuse[t](torch.cat([d, self.low[t](c1)], 1)))
        feats = self.xtask(feats, valid)
        out = {}
        for t, f in zip(TASKS, feats):
            out[t] = F.interpolate(self.heads[t](f), size=(H, W), mode="bilinear", align_corners=False)
        out["seg"] = self._mask_classes(out["seg"])
        out["valid"] = F.interpolate(self.valid_head(feats[1]), size=(H, W), mode="bilinear", align_corners=False)
        return out


# =====================================================================================
# losses
# =====================================================================================
class CosineNormalLoss(nn.Module):
    def forward(self, pred, gt, valid):
        pred = F.normalize(pred, dim=1)  # expect: AMP011
        cos = (pred * gt).sum(1)
        return (1.0 - cos)[valid].mean()


class UncertaintyWeighting(nn.Module):
    """L = sum_t exp(-s_t) * L_t + s_t  (s_t = log sigma_t^2); regression tasks get a 1/2"""

    def __init__(self, tasks, regression=("depth", "normal")):
        super().__init__()
        self.tasks = list(tasks)
        self.regression = set(regression)
        self.log_vars = nn.Parameter(torch.zeros(len(self.tasks)))

    def forward(self, losses):
        total = 0.0
        for i, t in enumerate(self.tasks):
            precision = torch.exp(-self.log_vars[i])
            factor = 0.5 if t in self.regression else 1.0
            total = total + factor * precision * losses[t] + 0.5 * self.log_vars[i]
        return total


# =====================================================================================
# trainer
# =====================================================================================
class MTLTrainer:
    def __init__(self, cfg, model, train_loader, val_loader):
        self.cfg = cfg
        self.device = torch.device("cuda")
        self.model = model.to(self.device)
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.weighting = UncertaintyWeighting(TASKS).to(self.device)

        backbone = [p for n, p in self.model.named_parameters() if n.startswith(("stem", "layer"))]
        rest = [p for n, p in self.model.named_parameters() if not n.startswith(("stem", "layer"))]
        self.optimizer = torch.optim.AdamW([
            {"params": backbone, "lr": cfg["lr"] * 0.1},
            {"params": rest, "lr": cfg["lr"]},
            {"params": self.weighting.parameters(), "lr": cfg["lr"], "weight_decay": 0.0},
        ], lr=cfg["lr"], weight_decay=cfg["wd"])
        self.scheduler = torch.optim.lr_scheduler.PolynomialLR(
            self.optimizer, total_iters=cfg["epochs"] * len(train_loader), power=0.9)

        self.use_amp = cfg.get("amp", True)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)
        self.autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16, enabled=self.use_amp)

        self.seg_criterion = nn.CrossEntropyLoss(ignore_index=255)
        self.edge_criterion = nn.BCELoss()
        self.normal_criterion = CosineNormalLoss()
        self.step = 0
        self.best = {"miou": 0.0, "abs_rel": 1e9}

    # ---------------------------------------------------------------------------------
    def compute_losses(self, preds, batch):
        losses = {}
        losses["seg"] = self.seg_criterion(preds["seg"], batch["seg"])
        valid = batch["depth"] > 0
        pred_depth = preds["depth"][:, 0][valid]
        gt_depth = batch["depth"][:, 0][valid]
        # scale-invariant log loss (Eigen et al.)
        d = torch.log(pred_depth + 1e-8) - torch.log(gt_depth + 1e-8)  # expect: AMP011
        losses["depth"] = (d ** 2).mean() - 0.85 * d.mean() ** 2
        losses["edge"] = self.edge_criterion(preds["edge"], batch["edge"])  # expect: AMP003
        losses["valid"] = F.binary_cross_entropy_with_logits(preds["valid"], valid.float())
        return losses

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _backward_and_step(self, loss):
        if self.use_amp:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            clip_grad_norm_(self.model.parameters(), self.cfg["clip"])
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            clip_grad_norm_(self.model.parameters(), self.cfg["clip"])
        self.optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def train_epoch(self, epoch):
        self.model.train()
        meter = {t: 0.0 for t in TASKS}
        n = 0
        t0 = time.time()
        for it, batch in enumerate(self.train_loader):
            batch = self._to_device(batch)
            valid_tokens = batch.get("valid_tokens")
            with self.autocast():
                preds = self.model(batch["image"], valid_tokens)
                losses = self.compute_losses(preds, batch)
            # normals: only where the depth sensor returned something
            gt_normal = batch["normal"]
            normal_valid = batch["depth"][:, 0] > 0
            losses["normal"] = self.normal_criterion(preds["normal"], gt_normal, normal_valid)  # expect: AMP002
            loss = self.weighting(losses) + 0.1 * losses["valid"]

            self._backward_and_step(loss)
            self.step += 1

            for t in TASKS:
                meter[t] += losses[t].item()
            n += 1
            if it % self.cfg["log_every"] == 0:
                sig = torch.exp(0.5 * self.weighting.log_vars).detach().cpu().numpy().round(3)
                log.info(f"ep {epoch} it {it} " + " ".join(f"{t}={meter[t] / n:.3f}" for t in TASKS)
                         + f" sigma={sig} {time.time() - t0:.0f}s")
        return {t: meter[t] / max(n, 1) for t in TASKS}

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        inter = torch.zeros(NUM_SEG_CLASSES, device=self.device)
        union = torch.zeros(NUM_SEG_CLASSES, device=self.device)
        abs_rel, n_px = 0.0, 0
        edge_bce = 0.0
        for batch in self.val_loader:
            batch = self._to_device(batch)
            with self.autocast():
                preds = self.model(batch["image"])
            seg = preds["seg"].argmax(1)
            gt = batch["seg"]
            keep = gt != 255
            for c in range(NUM_SEG_CLASSES):
                p, g = (seg == c) & keep, (gt == c) & keep
                inter[c] += (p & g).sum()
                union[c] += (p | g).sum()
            valid = batch["depth"] > 0
            pd = preds["depth"].float()[valid].clamp(min=1e-3)
            gd = batch["depth"][valid]
            abs_rel += ((pd - gd).abs() / gd).sum().item()
            n_px += valid.sum().item()
            with torch.autocast("cuda", enabled=False):
                edge_bce += F.binary_cross_entropy(preds["edge"].float(), batch["edge"]).item()
        miou = (inter / union.clamp(min=1)).mean().item()
        return {"miou": miou, "abs_rel": abs_rel / max(n_px, 1), "edge_bce": edge_bce / len(self.val_loader)}

    def fit(self):
        for epoch in range(self.cfg["epochs"]):
            tr = self.train_epoch(epoch)
            val = self.validate()
            log.info(f"epoch {epoch} train {json.dumps(tr)} val {json.dumps(val)}")
            if val["miou"] > self.best["miou"]:
                self.best.update(val)
                torch.save({"model": self.model.state_dict(), "weighting": self.weighting.state_dict(),
                            "scaler": self.scaler.state_dict(), "epoch": epoch},
                           os.path.join(self.cfg["out_dir"], "best.pth"))


def predict_folder(model, images, out_dir):
    """dump predictions for the qualitative figure"""
    model = copy.deepcopy(model).half().cuda().eval()
    os.makedirs(out_dir, exist_ok=True)
    for i, img in enumerate(images):
        with torch.inference_mode():
            out = model(img[None].half().cuda())
        np.save(os.path.join(out_dir, f"{i:04d}.npy"), {k: v.float().cpu().numpy() for k, v in out.items()})


def main():
    cfg = {
        "lr": 1e-4, "wd": 1e-4, "epochs": 100, "bs": 8, "clip": 10.0, "amp": True,
        "log_every": 50, "out_dir": "runs/mtl_uw", "data": "/data/nyuv2",
    }
    os.makedirs(cfg["out_dir"], exist_ok=True)
    logging.basicConfig(level=logging.INFO)
    train_ds = NYUv2(cfg["data"], split="train", augment=True)
    val_ds = NYUv2(cfg["data"], split="val")
    train_loader = DataLoader(train_ds, batch_size=cfg["bs"], shuffle=True, num_workers=8, drop_last=True,
                              pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["bs"], num_workers=4)
    class_mask = torch.ones(NUM_SEG_CLASSES, dtype=torch.bool)
    class_mask[[7, 11]] = False  # no 'tv' / 'painting' labels in our split
    model = MTLNet(pretrained=True, class_mask=class_mask)
    trainer = MTLTrainer(cfg, model, train_loader, val_loader)
    trainer.fit()


if __name__ == "__main__":
    main()
