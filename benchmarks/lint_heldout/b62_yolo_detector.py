"""
Train a YOLO-style single-stage detector on a custom dataset.

Usage:
    python b62_yolo_detector.py --data data/coco.yaml --cfg models/yolov5s.yaml --img 640 --batch-size 64
    python -m torch.distributed.run --nproc_per_node 4 b62_yolo_detector.py --sync-bn --multi-scale
"""
import argparse
import math
import random
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.optim import lr_scheduler

from models.yolo import Model
from utils.dataloaders import create_dataloader
from utils.general import non_max_suppression, xywh2xyxy
from utils.metrics import ap_per_class, box_iou, fitness

HYP = dict(lr0=0.01, lrf=0.01, momentum=0.937, weight_decay=5e-4, warmup_epochs=3.0,
           warmup_momentum=0.8, warmup_bias_lr=0.1, box=0.05, cls=0.5, cls_pw=1.0, obj=1.0,
           anchor_t=4.0, label_smoothing=0.0)


def de_parallel(model):
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class ModelEMA:
    """Exponential moving average of the model weights, kept in fp32."""

    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = de_parallel(model).state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def check_amp(model, imgsz=256):
    """Return True when fp16 autocast and a pure-fp16 copy reproduce the fp32 outputs on this GPU."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        return False
    im = torch.rand(1, 3, imgsz, imgsz, device=device)
    m = deepcopy(de_parallel(model)).eval()
    with torch.no_grad():
        a = m(im)[0]
        with torch.autocast("cuda", dtype=torch.float16):
            b = m(im)[0]
        c = deepcopy(m).half()(im.half())[0]
    return torch.allclose(a, b.float(), atol=0.1) and torch.allclose(a, c.float(), atol=0.1)


def bbox_iou(box1, box2, CIoU=False, eps=1e-7):
    (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.chunk(4, -1), box2.chunk(4, -1)
    b1_x1, b1_x2, b1_y1, b1_y2 = x1 - w1 / 2, x1 + w1 / 2, y1 - h1 / 2, y1 + h1 / 2
    b2_x1, b2_x2, b2_y1, b2_y2 = x2 - w2 / 2, x2 + w2 / 2, y2 - h2 / 2, y2 + h2 / 2
    inter = (torch.min(b1_x2, b2_x2) - torch.max(b1_x1, b2_x1)).clamp(0) * \
            (torch.min(b1_y2, b2_y2) - torch.max(b1_y1, b2_y1)).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if not CIoU:
        return iou
    cw = torch.max(b1_x2, b2_x2) - torch.min(b1_x1, b2_x1)
    ch = torch.max(b1_y2, b2_y2) - torch.min(b1_y1, b2_y1)
    c2 = cw ** 2 + ch ** 2 + eps
    rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2) ** 2 + (b2_y1 + b2_y2 - b1_y1 - b1_y2) ** 2) / 4
    v = (4 / math.pi ** 2) * (torch.atan(w2 / (h2 + eps)) - torch.atan(w1 / (h1 + eps))).pow(2)
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


class ComputeLoss:
    def __init__(self, model, hyp):
        device = next(model.parameters()).device
        self.hyp, self.device = hyp, device
        self.BCEcls = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([hyp["cls_pw"]], device=device))
        # objectness is scored on sigmoid(p) so that the IoU target stays a probability
        self.BCEobj = nn.BCELoss()
        eps = hyp.get("label_smoothing", 0.0)
        self.cp, self.cn = 1.0 - 0.5 * eps, 0.5 * eps
        det = de_parallel(model).model[-1]
        self.balance = {3: [4.0, 1.0, 0.4]}.get(det.nl, [4.0, 1.0, 0.25, 0.06, 0.02])
        self.na, self.nc, self.nl, self.anchors = det.na, det.nc, det.nl, det.anchors

    def __call__(self, p, targets):
        lcls = torch.zeros(1, device=self.device)
        lbox = torch.zeros(1, device=self.device)
        lobj = torch.zeros(1, device=self.device)
        tcls, tbox, indices, anch = self.build_targets(p, targets)
        for i, pi in enumerate(p):
            b, a, gj, gi = indices[i]
            tobj = torch.zeros(pi.shape[:4], dtype=pi.dtype, device=self.device)
            n = b.shape[0]
            if n:
                pxy, pwh, _, pcls = pi[b, a, gj, gi].split((2, 2, 1, self.nc), 1)
                pxy = pxy.sigmoid() * 2 - 0.5
                pwh = (pwh.sigmoid() * 2) ** 2 * anch[i]
                iou = bbox_iou(torch.cat((pxy, pwh), 1), tbox[i], CIoU=True).squeeze()
                lbox += (1.0 - iou).mean()
                tobj[b, a, gj, gi] = iou.detach().clamp(0).type(tobj.dtype)
                if self.nc > 1:
                    t = torch.full_like(pcls, self.cn, device=self.device)
                    t[range(n), tcls[i]] = self.cp
                    lcls += self.BCEcls(pcls, t)
            obji = self.BCEobj(pi[..., 4].sigmoid(), tobj)  # expect: AMP003
            lobj += obji * self.balance[i]
        lbox *= self.hyp["box"]
        lobj *= self.hyp["obj"]
        lcls *= self.hyp["cls"]
        return (lbox + lobj + lcls) * tobj.shape[0], torch.cat((lbox, lobj, lcls)).detach()

    def build_targets(self, p, targets):
        na, nt = self.na, targets.shape[0]
        tcls, tbox, indices, anch = [], [], [], []
        gain = torch.ones(7, device=self.device)
        ai = torch.arange(na, device=self.device).float().view(na, 1).repeat(1, nt)
        targets = torch.cat((targets.repeat(na, 1, 1), ai[..., None]), 2)
        for i in range(self.nl):
            anchors, shape = self.anchors[i], p[i].shape
            gain[2:6] = torch.tensor(shape)[[3, 2, 3, 2]]
            t = targets * gain
            if nt:
                r = t[..., 4:6] / anchors[:, None]
                t = t[torch.max(r, 1 / r).max(2)[0] < self.hyp["anchor_t"]]
            else:
                t = targets[0]
            bc, gxy, gwh, a = t.chunk(4, 1)
            a, (b, c) = a.long().view(-1), bc.long().T
            gij = gxy.long()
            gi, gj = gij.T
            indices.append((b, a, gj.clamp_(0, shape[2] - 1), gi.clamp_(0, shape[3] - 1)))
            tbox.append(torch.cat((gxy - gij, gwh), 1))
            anch.append(anchors[a])
            tcls.append(c)
        return tcls, tbox, indices, anch


def match_predictions(pred, labels, iouv):
    """Greedy one-to-one matching of detections to ground truth at each IoU threshold."""
    correct = np.zeros((pred.shape[0], iouv.numel()), dtype=bool)
    iou = box_iou(labels[:, 1:], pred[:, :4]).cpu().numpy()
    iou[labels[:, 0:1].cpu().numpy() != pred[:, 5].cpu().numpy()] = -1e9
    for k, thr in enumerate(iouv.tolist()):
        gt_idx, det_idx = np.nonzero(iou >= thr)
        if gt_idx.size:
            order = np.argsort(-iou[gt_idx, det_idx])
            gt_idx, det_idx = gt_idx[order], det_idx[order]
            _, keep = np.unique(det_idx, return_index=True)
            gt_idx, det_idx = gt_idx[keep], det_idx[keep]
            _, keep = np.unique(gt_idx, return_index=True)
            correct[det_idx[keep], k] = True
    return torch.from_numpy(correct)


@torch.no_grad()
def validate(model, dataloader, conf_thres=0.001, iou_thres=0.6, half=True):
    device = next(model.parameters()).device
    half &= device.type != "cpu"
    model.half() if half else model.float()
    model.eval()
    iouv = torch.linspace(0.5, 0.95, 10, device=device)
    stats = []
    for im, targets, _, _ in dataloader:
        im = (im.half() if half else im.float()).to(device, non_blocking=True) / 255
        _, _, height, width = im.shape
        targets = targets.to(device)
        targets[:, 2:] *= torch.tensor((width, height, width, height), device=device)
        preds = non_max_suppression(model(im)[0], conf_thres, iou_thres, multi_label=True)
        for si, pred in enumerate(preds):
            labels = targets[targets[:, 0] == si, 1:]
            correct = torch.zeros(pred.shape[0], iouv.numel(), dtype=torch.bool)
            if labels.shape[0] and pred.shape[0]:
                gt = torch.cat((labels[:, 0:1], xywh2xyxy(labels[:, 1:5])), 1)
                correct = match_predictions(pred, gt, iouv)
            stats.append((correct, pred[:, 4].cpu(), pred[:, 5].cpu(), labels[:, 0].cpu()))
    stats = [torch.cat(x, 0).numpy() for x in zip(*stats)]
    _, _, p, r, _, ap, _ = ap_per_class(*stats)
    model.float()
    return p.mean(), r.mean(), ap[:, 0].mean(), ap.mean()


def strip_optimizer(f):
    """Drop the optimizer from a finished checkpoint and keep the EMA weights in fp16."""
    x = torch.load(f, map_location="cpu", weights_only=False)
    x["model"] = x.get("ema") or x["model"]
    for k in "optimizer", "best_fitness", "ema", "updates":
        x[k] = None
    x["model"].half()
    for p in x["model"].parameters():
        p.requires_grad = False
    torch.save(x, f)


def train(hyp, opt, device):
    last, best = Path(opt.save_dir) / "last.pt", Path(opt.save_dir) / "best.pt"
    data = yaml.safe_load(open(opt.data))
    model = Model(opt.cfg, ch=3, nc=int(data["nc"])).to(device)
    amp = check_amp(model)
    gs = max(int(model.stride.max()), 32)
    imgsz, nbs = opt.imgsz, 64
    accumulate = max(round(nbs / opt.batch_size), 1)
    hyp["weight_decay"] *= opt.batch_size * accumulate / nbs

    g = [], [], []
    norms = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for mod in model.modules():
        for p_name, p in mod.named_parameters(recurse=False):
            if p_name == "bias":
                g[2].append(p)
            elif p_name == "weight" and isinstance(mod, norms):
                g[1].append(p)
            else:
                g[0].append(p)
    if opt.optimizer == "AdamW":
        optimizer = torch.optim.AdamW(g[2], lr=hyp["lr0"], betas=(hyp["momentum"], 0.999))
    else:
        optimizer = torch.optim.SGD(g[2], lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": hyp["weight_decay"]})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    lf = lambda x: (1 - x / opt.epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]  # noqa: E731
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)
    try:
        scaler = torch.amp.GradScaler("cuda", enabled=amp)
    except (AttributeError, TypeError):  # torch < 2.3
        scaler = torch.cuda.amp.GradScaler(enabled=amp)

    train_loader, _ = create_dataloader(data["train"], imgsz, opt.batch_size, gs, hyp=hyp, augment=True)
    val_loader = create_dataloader(data["val"], imgsz, opt.batch_size * 2, gs, pad=0.5)[0]
    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step, best_fitness = -1, 0.0
    compute_loss = ComputeLoss(model, hyp)
    for epoch in range(opt.epochs):
        model.train()
        mloss = torch.zeros(3, device=device)
        optimizer.zero_grad()
        for i, (imgs, targets, _, _) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255
            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / opt.batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    start = hyp["warmup_bias_lr"] if j == 0 else 0.0
                    x["lr"] = np.interp(ni, xi, [start, x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]])
            if opt.multi_scale:
                sz = random.randrange(int(imgsz * 0.5), int(imgsz * 1.5) + gs) // gs * gs
                sf = sz / max(imgs.shape[2:])
                if sf != 1:
                    ns = [math.ceil(x * sf / gs) * gs for x in imgs.shape[2:]]
                    imgs = F.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)

            with torch.autocast("cuda", enabled=amp):
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
            scaler.scale(loss).backward()
            if ni - last_opt_step >= accumulate:
                optimizer.step()  # expect: AMP006
                optimizer.zero_grad()
                ema.update(model)
                last_opt_step = ni
            mloss = (mloss * i + loss_items) / (i + 1)
            if i % 50 == 0:
                print(f"{epoch}/{opt.epochs - 1} {i}/{nb} losses {mloss.tolist()} img {imgs.shape[-1]}")
        scheduler.step()

        results = validate(ema.ema, val_loader, half=amp)
        fi = fitness(np.array(results).reshape(1, -1))
        best_fitness = max(best_fitness, float(fi))
        ckpt = {"epoch": epoch, "best_fitness": best_fitness,
                "model": deepcopy(de_parallel(model)).half(), "ema": deepcopy(ema.ema).half(),
                "updates": ema.updates, "optimizer": optimizer.state_dict(), "opt": vars(opt)}
        torch.save(ckpt, last)
        if best_fitness == float(fi):
            torch.save(ckpt, best)
    for f in last, best:
        if f.exists():
            strip_optimizer(f)


def parse_opt():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="models/yolov5s.yaml")
    parser.add_argument("--data", default="data/coco128.yaml")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--imgsz", "--img", type=int, default=640)
    parser.add_argument("--multi-scale", action="store_true")
    parser.add_argument("--optimizer", choices=["SGD", "AdamW"], default="SGD")
    parser.add_argument("--save-dir", default="runs/train/exp")
    return parser.parse_args()


if __name__ == "__main__":
    opt = parse_opt()
    train(dict(HYP), opt, torch.device("cuda:0" if torch.cuda.is_available() else "cpu"))
