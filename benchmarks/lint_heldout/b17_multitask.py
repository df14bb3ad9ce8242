"""Multi-task dense prediction: semantic segmentation, depth, scene class and attributes.

One shared conv encoder, four heads, task weights learned with homoscedastic
uncertainty (Kendall et al. 2018). Trained on a mix of datasets, so the scene
classifier receives a per-sample mask of the classes its source dataset labels.
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

TASKS = ("seg", "depth", "cls", "attr")


def conv_bn_relu(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class Encoder(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        chans = [width, width * 2, width * 4, width * 8]
        self.channels = chans
        stages, cin = [], 3
        for i, c in enumerate(chans):
            stages.append(nn.Sequential(conv_bn_relu(cin, c, stride=2), conv_bn_relu(c, c)))
            cin = c
        self.stages = nn.ModuleList(stages)

    def forward(self, x):
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        return feats


class SegHead(nn.Module):
    def __init__(self, chans, num_classes, dim=128):
        super().__init__()
        self.lateral = nn.ModuleList([nn.Conv2d(c, dim, 1) for c in chans])
        self.fuse = conv_bn_relu(dim, dim)
        self.cls = nn.Conv2d(dim, num_classes, 1)

    def forward(self, feats, size):
        x = self.lateral[-1](feats[-1])
        for lat, f in zip(reversed(self.lateral[:-1]), reversed(feats[:-1])):
            x = F.interpolate(x, size=f.shape[-2:], mode="bilinear", align_corners=False) + lat(f)
        x = self.cls(self.fuse(x))
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class DepthHead(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.body = nn.Sequential(conv_bn_relu(cin, 128), conv_bn_relu(128, 64))
        self.pred = nn.Conv2d(64, 1, 3, padding=1)

    def forward(self, x, size):
        disp = torch.sigmoid(self.pred(self.body(x)))
        depth = 1.0 / (disp + 1e-8)  # expect: AMP011
        return F.interpolate(depth, size=size, mode="bilinear", align_corners=False)


class ClsHead(nn.Module):
    def __init__(self, cin, num_classes, hidden=512, drop=0.2):
        super().__init__()
        self.proj = nn.Conv2d(cin, hidden, 1)
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x, class_mask=None):
        x = self.proj(x)
        pooled = x.mean(dim=(2, 3))  # expect: AMP004
        logits = self.fc(self.drop(pooled))
        if class_mask is not None:
            logits = logits.masked_fill(~class_mask, -1e9)  # expect: AMP007
        return logits


class AttrHead(nn.Module):
    def __init__(self, cin, num_attr):
        super().__init__()
        self.fc = nn.Linear(cin, num_attr)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class MultiTaskNet(nn.Module):
    def __init__(self, num_seg, num_cls, num_attr, width=64):
        super().__init__()
        self.encoder = Encoder(width)
        chans = self.encoder.channels
        self.seg_head = SegHead(chans, num_seg)
        self.seg_aux = nn.Sequential(conv_bn_relu(chans[-2], 128), nn.Conv2d(128, num_seg, 1))
        self.depth_head = DepthHead(chans[-1])
        self.cls_head = ClsHead(chans[-1], num_cls)
        self.attr_head = AttrHead(chans[-1], num_attr)

    def forward(self, img, class_mask=None):
        feats = self.encoder(img)
        size = img.shape[-2:]
        aux = F.interpolate(self.seg_aux(feats[-2]), size=size, mode="bilinear", align_corners=False)
        return {
            "seg": self.seg_head(feats, size),
            "seg_aux": aux,
            "depth": self.depth_head(feats[-1], size),
            "cls": self.cls_head(feats[-1], class_mask),
            "attr": self.attr_head(feats[-1]),
        }


class MultiTaskLoss(nn.Module):
    """Uncertainty weighting: L = sum_t exp(-s_t) * L_t + s_t."""

    def __init__(self, tasks=TASKS, ignore_index=255):
        super().__init__()
        self.tasks = tasks
        self.log_vars = nn.Parameter(torch.zeros(len(tasks)))
        self.seg_ce = nn.CrossEntropyLoss(ignore_index=ignore_index)
        self.attr_bce = nn.BCELoss()

    def forward(self, out, tgt):
        raw = {}
        raw["seg"] = self.seg_ce(out["seg"], tgt["seg"])
        valid = tgt["depth"] > 0
        raw["depth"] = F.l1_loss(torch.log(out["depth"][valid]), torch.log(tgt["depth"][valid]))
        raw["cls"] = F.cross_entropy(out["cls"], tgt["cls"], label_smoothing=0.1)
        raw["attr"] = self.attr_bce(torch.sigmoid(out["attr"]), tgt["attr"].float())  # expect: AMP003
        weighted = {}
        for i, t in enumerate(self.tasks):
            precision = torch.exp(-self.log_vars[i])
            weighted[t] = precision * raw[t] + self.log_vars[i]
        return weighted, raw


@torch.inference_mode()
def evaluate(model, loader, num_seg, device="cuda"):
    model.eval()
    inter = torch.zeros(num_seg, device=device)
    union = torch.zeros(num_seg, device=device)
    abs_rel, n_pix, correct, n = 0.0, 0, 0, 0
    for img, tgt in loader:
        img = img.to(device, non_blocking=True)
        tgt = {k: v.to(device, non_blocking=True) for k, v in tgt.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(img, class_mask=tgt.get("class_mask"))
        pred = out["seg"].argmax(1)
        keep = tgt["seg"] != 255
        for c in range(num_seg):
            p, g = (pred == c) & keep, (tgt["seg"] == c) & keep
            inter[c] += (p & g).sum()
            union[c] += (p | g).sum()
        d_pred, d_gt = out["depth"].float(), tgt["depth"]
        valid = d_gt > 0
        abs_rel += ((d_pred[valid] - d_gt[valid]).abs() / d_gt[valid]).sum().item()
        n_pix += int(valid.sum())
        correct += (out["cls"].argmax(1) == tgt["cls"]).sum().item()
        n += img.size(0)
    miou = (inter / union.clamp(min=1)).mean().item()
    model.train()
    return {"miou": miou, "abs_rel": abs_rel / max(n_pix, 1), "acc": correct / max(n, 1)}


def finetune_heads(model, loader, criterion, epochs, lr=1e-3, device="cuda"):
    """Re-fit the heads on a new dataset with the encoder frozen."""
    for p in model.encoder.parameters():
        p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    model.train()
    for _ in range(epochs):
        for img, tgt in loader:
            img = img.to(device, non_blocking=True)
            tgt = {k: v.to(device, non_blocking=True) for k, v in tgt.items()}
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                out = model(img, class_mask=tgt.get("class_mask"))
                weighted, _ = criterion(out, tgt)
                total = sum(weighted.values())
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
    for p in model.encoder.parameters():
        p.requires_grad_(True)


def train(args):
    device = "cuda"
    train_loader = DataLoader(torch.load(args.train_set), batch_size=args.bs, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.load(args.val_set), batch_size=args.bs, num_workers=8)
    model = MultiTaskNet(args.num_seg, args.num_cls, args.num_attr).to(device)
    criterion = MultiTaskLoss().to(device)
    groups = [
        {"params": model.parameters(), "weight_decay": args.wd},
        {"params": criterion.parameters(), "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    scaler = torch.amp.GradScaler("cuda")
    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for img, tgt in train_loader:
            img = img.to(device, non_blocking=True)
            tgt = {k: v.to(device, non_blocking=True) for k, v in tgt.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img, class_mask=tgt.get("class_mask"))
                weighted, raw = criterion(out, tgt)
            # deep supervision on the stride-16 features, added for the ADE runs
            weighted["seg_aux"] = args.aux_w * F.cross_entropy(out["seg_aux"], tgt["seg"], ignore_index=255)  # expect: AMP002
            total = sum(weighted.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(total).backward()
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                parts = " ".join(f"{k}={v.item():.3f}" for k, v in raw.items())
                sigmas = torch.exp(0.5 * criterion.log_vars.detach()).tolist()
                print(f"ep {epoch} step {step} total={total.item():.3f} {parts} sigma={sigmas}")
        metrics = evaluate(model, val_loader, args.num_seg)
        print(f"epoch {epoch} done in {time.time() - t0:.0f}s: {metrics}")
        torch.save({"model": model.state_dict(), "criterion": criterion.state_dict()},
                   os.path.join(args.out, f"mt_{epoch:03d}.pth"))
    if args.adapt_set:
        adapt_loader = DataLoader(torch.load(args.adapt_set), batch_size=args.bs, shuffle=True)
        finetune_heads(model, adapt_loader, criterion, epochs=args.adapt_epochs)
    return model


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--train_set", required=True)
    p.add_argument("--val_set", required=True)
    p.add_argument("--adapt_set", default="")
    p.add_argument("--adapt_epochs", type=int, default=3)
    p.add_argument("--num_seg", type=int, default=150)
    p.add_argument("--num_cls", type=int, default=365)
    p.add_argument("--num_attr", type=int, default=102)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--aux_w", type=float, default=0.4)
    p.add_argument("--clip_grad", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--out", default="checkpoints")
    train(p.parse_args())
