"""Train a small anchor-based YOLO detector (YOLOv5-style loop, AMP on CUDA)."""
import argparse
import copy
import math
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

TORCH_2_4 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 4)
ANCHORS = ([10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326])


class Conv(nn.Module):
    def __init__(self, c1, c2, k=1, s=1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)

    def forward(self, x):
        return F.silu(self.bn(self.conv(x)))


class Detect(nn.Module):
    def __init__(self, nc, anchors, ch):
        super().__init__()
        self.nc, self.no, self.nl, self.na = nc, nc + 5, len(anchors), len(anchors[0]) // 2
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)

    def forward(self, xs):
        out = []
        for conv, x in zip(self.m, xs):
            x = conv(x)
            out.append(x.view(x.shape[0], self.na, self.no, *x.shape[2:]).permute(0, 1, 3, 4, 2).contiguous())
        return out


class TinyYOLO(nn.Module):
    def __init__(self, nc=80):
        super().__init__()
        self.stem = nn.Sequential(Conv(3, 32, 6, 2), Conv(32, 64, 3, 2), Conv(64, 64, 3, 1))
        self.p3 = nn.Sequential(Conv(64, 128, 3, 2), Conv(128, 128, 3, 1))
        self.p4 = Conv(128, 256, 3, 2)
        self.p5 = Conv(256, 512, 3, 2)
        self.detect = Detect(nc, ANCHORS, (128, 256, 512))

    def forward(self, x):
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        return self.detect([p3, p4, self.p5(p4)])


def bbox_iou(box1, box2, eps=1e-7):
    (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.chunk(4, -1), box2.chunk(4, -1)
    inter_w = (torch.min(x1 + w1 / 2, x2 + w2 / 2) - torch.max(x1 - w1 / 2, x2 - w2 / 2)).clamp(0)
    inter_h = (torch.min(y1 + h1 / 2, y2 + h2 / 2) - torch.max(y1 - h1 / 2, y2 - h2 / 2)).clamp(0)
    union = w1 * h1 + w2 * h2 - inter_w * inter_h + eps
    return (inter_w * inter_h / union).squeeze(-1)


class ComputeLoss:
    def __init__(self, model, hyp):
        self.device = next(model.parameters()).device
        self.hyp = hyp
        self.BCEcls = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([hyp["cls_pw"]], device=self.device))
        self.BCEobj = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([hyp["obj_pw"]], device=self.device))
        self.bce_iou = nn.BCELoss()
        self.balance = [4.0, 1.0, 0.4]
        det = model.detect
        self.na, self.nc, self.nl, self.anchors = det.na, det.nc, det.nl, det.anchors

    def __call__(self, p, targets):
        lcls, lbox, lobj, liou = (torch.zeros(1, device=self.device) for _ in range(4))
        tcls, tbox, indices, anchors = self.build_targets(p, targets)
        for i, pi in enumerate(p):
            b, a, gj, gi = indices[i]
            tobj = torch.zeros(pi.shape[:4], dtype=pi.dtype, device=self.device)
            if b.shape[0]:
                ps = pi[b, a, gj, gi].float()
                pxy = ps[:, :2].sigmoid() * 2 - 0.5
                pwh = (ps[:, 2:4].sigmoid() * 2) ** 2 * anchors[i]
                iou = bbox_iou(torch.cat((pxy, pwh), 1), tbox[i])
                lbox += (1.0 - iou).mean()
                tobj[b, a, gj, gi] = iou.detach().clamp(0).type(tobj.dtype)
                if self.nc > 1:
                    t = torch.full_like(ps[:, 5:], 0.0)
                    t[range(b.shape[0]), tcls[i]] = 1.0
                    lcls += self.BCEcls(ps[:, 5:], t)
                if self.hyp.get("iou_aware"):
                    liou += self.bce_iou(ps[:, 4].sigmoid(), iou.detach().clamp(0, 1))  # expect: AMP003
            lobj += self.BCEobj(pi[..., 4], tobj) * self.balance[i]
        components = torch.cat((lbox * self.hyp["box"], lobj * self.hyp["obj"], lcls * self.hyp["cls"]))
        return (components.sum() + 0.5 * liou.sum()) * p[0].shape[0], components

    def build_targets(self, p, targets):
        tcls, tbox, indices, anch = [], [], [], []
        gain = torch.ones(6, device=self.device)
        for i in range(self.nl):
            anchors, shape = self.anchors[i], p[i].shape
            gain[2:6] = torch.tensor(shape, device=self.device)[[3, 2, 3, 2]].float()
            t = targets * gain
            r = t[None, :, 4:6] / anchors[:, None]
            j = torch.max(r, 1 / r).max(2)[0] < self.hyp["anchor_t"]
            ai = torch.arange(self.na, device=self.device)[:, None].expand(-1, t.shape[0])
            t, a = t.repeat(self.na, 1, 1)[j], ai[j]
            b, c = t[:, :2].long().T
            gxy, gwh = t[:, 2:4], t[:, 4:6]
            gi, gj = gxy.long().T
            gj, gi = gj.clamp_(0, shape[2] - 1), gi.clamp_(0, shape[3] - 1)
            indices.append((b, a, gj, gi))
            tbox.append(torch.cat((gxy - torch.stack((gi, gj), 1), gwh), 1))
            anch.append(anchors[a])
            tcls.append(c)
        return tcls, tbox, indices, anch


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000):
        self.ema = copy.deepcopy(model).eval()
        self.updates = 0
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        self.ema.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


@torch.no_grad()
def validate(model, loader, compute_loss, device, half=True):
    half &= device.type != "cpu"
    model.half() if half else model.float()
    model.eval()
    loss = torch.zeros(3, device=device)
    for im, targets in loader:
        im = im.to(device, non_blocking=True)
        im = (im.half() if half else im.float()) / 255
        preds = model(im)
        loss += compute_loss([x.float() for x in preds], targets.to(device))[1]
    model.float()
    return (loss.cpu() / len(loader)).tolist()


def train(hyp, opt, device):
    model = TinyYOLO(nc=opt.nc).to(device)
    amp = device.type != "cpu"
    g_bn = [m.weight for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    g_w = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    g_b = [m.bias for m in model.modules() if isinstance(getattr(m, "bias", None), nn.Parameter)]
    if opt.optimizer == "Adam":
        optimizer = torch.optim.Adam(g_bn, lr=hyp["lr0"], betas=(hyp["momentum"], 0.999))
    else:
        optimizer = torch.optim.SGD(g_bn, lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True)
    optimizer.add_param_group({"params": g_w, "weight_decay": hyp["weight_decay"]})
    optimizer.add_param_group({"params": g_b})
    log_vars = nn.Parameter(torch.zeros(3, device=device))
    weight_optimizer = torch.optim.Adam([log_vars], lr=1e-3)
    ema = ModelEMA(model)
    scaler = torch.amp.GradScaler("cuda", enabled=amp) if TORCH_2_4 else torch.cuda.amp.GradScaler(enabled=amp)
    compute_loss = ComputeLoss(model, hyp)
    train_loader, val_loader = build_loaders(opt)  # noqa: F821  (project helper)
    nb, nw = len(train_loader), max(round(hyp["warmup_epochs"] * len(train_loader)), 100)
    last_opt_step, accumulate, best_fitness = -1, max(round(64 / opt.batch_size), 1), 0.0
    for epoch in range(opt.epochs):
        model.train()
        optimizer.zero_grad()
        for i, (imgs, targets) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).half() / 255  # expect: AMP001
            if ni <= nw:
                accumulate = max(1, np.interp(ni, [0, nw], [1, 64 / opt.batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, [0, nw], [hyp["warmup_bias_lr"] if j == 2 else 0.0, hyp["lr0"]])
            if opt.multi_scale:
                sz = random.randrange(opt.imgsz // 2, opt.imgsz * 3 // 2 + 32) // 32 * 32
                imgs = F.interpolate(imgs, size=[sz, sz], mode="bilinear", align_corners=False)
            with torch.amp.autocast("cuda", enabled=amp):
                pred = model(imgs)
                loss, components = compute_loss(pred, targets.to(device))
                if opt.learn_loss_weights:
                    loss = imgs.shape[0] * (torch.exp(-log_vars) * components + log_vars).sum()
            scaler.scale(loss).backward()
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                if opt.learn_loss_weights:
                    weight_optimizer.step()  # expect: AMP006
                    weight_optimizer.zero_grad()
                optimizer.zero_grad()
                ema.update(model)
                last_opt_step = ni
        box, obj, cls = validate(ema.ema, val_loader, compute_loss, device)
        fitness = -(box + obj + cls)
        best_fitness = max(best_fitness, fitness) if epoch else fitness
        ckpt = {"epoch": epoch, "best_fitness": best_fitness, "model": copy.deepcopy(model).half(),
                "ema": copy.deepcopy(ema.ema).half(), "updates": ema.updates, "optimizer": optimizer.state_dict()}
        torch.save(ckpt, f"{opt.save_dir}/last.pt")
    return ema.ema


def export_onnx(model, imgsz, f="yolo.onnx"):
    model = copy.deepcopy(model).half().eval()
    im = torch.zeros(1, 3, imgsz, imgsz, device=next(model.parameters()).device).half()
    torch.onnx.export(model, im, f, opset_version=17, input_names=["images"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag, default in (("--nc", 80), ("--epochs", 100), ("--batch-size", 16), ("--imgsz", 640)):
        parser.add_argument(flag, type=int, default=default)
    for flag in ("--multi-scale", "--learn-loss-weights"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--optimizer", choices=["SGD", "Adam"], default="SGD")
    parser.add_argument("--save-dir", default="runs/train/exp")
    opt = parser.parse_args()
    hyp = {"lr0": 0.01, "momentum": 0.937, "weight_decay": 5e-4, "warmup_epochs": 3.0, "warmup_bias_lr": 0.1,
           "box": 0.05, "obj": 1.0, "cls": 0.5, "cls_pw": 1.0, "obj_pw": 1.0, "anchor_t": 4.0, "iou_aware": False}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    export_onnx(train(hyp, opt, device), opt.imgsz)
