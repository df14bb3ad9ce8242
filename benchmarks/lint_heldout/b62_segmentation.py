"""
Semantic segmentation training: DeepLabV3+-style head on a dilated ResNet-50.

    python b62_segmentation.py --data-root /data/cityscapes --crop 768 --iters 80000 --batch-size 8

Poly learning-rate schedule with linear warmup, OHEM cross-entropy, an auxiliary FCN head,
a boundary head, and sliding-window (optionally flipped) evaluation.
"""
import argparse
import copy
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.models import resnet50
from torchvision.models._utils import IntermediateLayerGetter

from datasets.cityscapes import CityscapesSegmentation


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin, cout, k=3, d=1):
        super().__init__(nn.Conv2d(cin, cout, k, padding=d * (k // 2), dilation=d, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class ASPP(nn.Module):
    def __init__(self, cin, cout=256, rates=(12, 24, 36)):
        super().__init__()
        self.branches = nn.ModuleList([ConvBNReLU(cin, cout, 1)] + [ConvBNReLU(cin, cout, 3, r) for r in rates])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1, bias=False), nn.ReLU(inplace=True))
        self.project = ConvBNReLU(cout * (len(rates) + 2), cout, 1)

    def forward(self, x):
        outs = [branch(x) for branch in self.branches]
        outs.append(F.interpolate(self.pool(x), size=x.shape[-2:], mode="bilinear", align_corners=False))
        return self.project(torch.cat(outs, dim=1))


class SegModel(nn.Module):
    def __init__(self, num_classes, aux=True):
        super().__init__()
        backbone = resnet50(weights="IMAGENET1K_V2", replace_stride_with_dilation=[False, True, True])
        self.backbone = IntermediateLayerGetter(backbone, {"layer1": "low", "layer3": "aux", "layer4": "out"})
        self.aspp = ASPP(2048)
        self.ctx_proj = nn.Conv2d(256, 256, 1)
        self.low_proj = ConvBNReLU(256, 48, 1)
        self.decoder = nn.Sequential(ConvBNReLU(304, 256), ConvBNReLU(256, 256))
        self.classifier = nn.Conv2d(256, num_classes, 1)
        self.edge_head = nn.Conv2d(256, 1, 1)
        self.aux_head = nn.Sequential(ConvBNReLU(1024, 256), nn.Dropout(0.1), nn.Conv2d(256, num_classes, 1)) \
            if aux else None

    def forward(self, x):
        size = x.shape[-2:]
        feats = self.backbone(x)
        y = self.aspp(feats["out"])
        # image-level context gate (squeeze-and-excite over the ASPP output)
        ctx = self.ctx_proj(y)
        gate = torch.sigmoid(ctx.mean(dim=(2, 3), keepdim=True))  # expect: AMP004
        y = F.interpolate(y * gate, size=feats["low"].shape[-2:], mode="bilinear", align_corners=False)
        y = self.decoder(torch.cat([y, self.low_proj(feats["low"])], dim=1))
        out = {"out": F.interpolate(self.classifier(y), size=size, mode="bilinear", align_corners=False),
               "edge": F.interpolate(self.edge_head(y), size=size, mode="bilinear", align_corners=False)}
        if self.aux_head is not None and self.training:
            aux = self.aux_head(feats["aux"])
            out["aux"] = F.interpolate(aux, size=size, mode="bilinear", align_corners=False)
        return out


class OhemCrossEntropy(nn.Module):
    def __init__(self, ignore_index=255, thresh=0.7, min_kept=100000, weight=None):
        super().__init__()
        self.thresh, self.min_kept, self.ignore_index = thresh, max(1, min_kept), ignore_index
        self.criterion = nn.CrossEntropyLoss(weight=weight, ignore_index=ignore_index, reduction="none")

    def forward(self, logits, target):
        pixel_losses = self.criterion(logits, target).contiguous().view(-1)
        mask = target.contiguous().view(-1) != self.ignore_index
        tmp_target = target.clone()
        tmp_target[tmp_target == self.ignore_index] = 0
        prob = F.softmax(logits, dim=1).gather(1, tmp_target.unsqueeze(1)).contiguous().view(-1)[mask]
        if prob.numel() == 0:
            return logits.sum() * 0.0
        pred, ind = prob.sort()
        threshold = max(pred[min(self.min_kept, pred.numel() - 1)].item(), self.thresh)
        pixel_losses = pixel_losses[mask][ind]
        return pixel_losses[pred < threshold].mean()


def label_to_edge(labels, ignore_index=255, radius=2):
    """Binary boundary map from a label map: pixels whose neighbourhood holds another class."""
    lab = labels.clone().float()
    lab[labels == ignore_index] = -1
    k = 2 * radius + 1
    up = F.max_pool2d(lab[:, None], k, stride=1, padding=radius)
    down = -F.max_pool2d(-lab[:, None], k, stride=1, padding=radius)
    return (up != down).float()


def poly_lr(optimizer, base_lr, it, max_iters, power=0.9, warmup=0, warmup_ratio=1e-6):
    if it < warmup:
        lr = base_lr * (warmup_ratio + (1 - warmup_ratio) * it / warmup)
    else:
        lr = base_lr * (1 - (it - warmup) / (max_iters - warmup)) ** power
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    return lr


@torch.no_grad()
def slide_inference(model, img, num_classes, crop, stride):
    b, _, h, w = img.shape
    pad_h, pad_w = max(crop - h, 0), max(crop - w, 0)
    img = F.pad(img, (0, pad_w, 0, pad_h), value=0.0)
    H, W = img.shape[-2:]
    h_grids = max(H - crop + stride - 1, 0) // stride + 1
    w_grids = max(W - crop + stride - 1, 0) // stride + 1
    preds = img.new_zeros((b, num_classes, H, W))
    count = img.new_zeros((b, 1, H, W))
    for hi in range(h_grids):
        for wi in range(w_grids):
            y2, x2 = min(hi * stride + crop, H), min(wi * stride + crop, W)
            y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img[:, :, y1:y2, x1:x2])["out"]
            preds += F.pad(logits.float().softmax(dim=1), (x1, W - x2, y1, H - y2))
            count[:, :, y1:y2, x1:x2] += 1
    return (preds / count)[:, :, :h, :w]


@torch.no_grad()
def evaluate(model, loader, num_classes, args, device):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
    for img, label in loader:
        img, label = img.to(device, non_blocking=True), label.to(device, non_blocking=True).long()
        prob = slide_inference(model, img, num_classes, args.crop, args.stride)
        if args.flip:
            prob += slide_inference(model, img.flip(-1), num_classes, args.crop, args.stride).flip(-1)
        pred = prob.argmax(1)
        valid = label != 255
        idx = label[valid] * num_classes + pred[valid]
        hist += torch.bincount(idx, minlength=num_classes ** 2).view(num_classes, num_classes).double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag() + 1e-10)
    model.train()
    return iou.mean().item(), iou.cpu().tolist()


def export_onnx(model, path, size=(1024, 2048)):
    """Export an fp16 graph for the TensorRT deployment."""
    m = copy.deepcopy(model).eval().half()
    dummy = torch.randn(1, 3, *size, device=next(m.parameters()).device, dtype=torch.float16)
    torch.onnx.export(m, dummy, path, opset_version=17, input_names=["image"], output_names=["out"])


def train(args):
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    train_set = CityscapesSegmentation(args.data_root, split="train", crop=args.crop, scale=(0.5, 2.0))
    val_set = CityscapesSegmentation(args.data_root, split="val")
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, num_workers=4)

    model = SegModel(args.num_classes, aux=True)
    model.to(device)
    model.to(memory_format=torch.channels_last)
    criterion = OhemCrossEntropy(ignore_index=255, thresh=args.ohem_thresh, min_kept=args.ohem_min_kept)
    backbone_params = list(model.backbone.parameters())
    head_params = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.SGD([{"params": backbone_params, "lr_mult": 1.0},
                                 {"params": head_params, "lr_mult": 10.0}],
                                lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cuda")

    start_iter, best_miou = 0, -1.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_iter, best_miou = ckpt["iter"], ckpt["best_miou"]

    model.train()
    it, t0 = start_iter, time.time()
    loader_iter = iter(train_loader)
    while it < args.iters:
        try:
            images, labels = next(loader_iter)
        except StopIteration:
            loader_iter = iter(train_loader)
            images, labels = next(loader_iter)
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True).long()
        lr = poly_lr(optimizer, args.lr, it, args.iters, power=0.9, warmup=args.warmup_iters)
        edge_gt = label_to_edge(labels)

        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
            loss = criterion(outputs["out"], labels)
            if "aux" in outputs:
                loss = loss + args.aux_weight * criterion(outputs["aux"], labels)
            with torch.autocast("cuda", enabled=False):
                edge_prob = torch.sigmoid(outputs["edge"].float())
                loss = loss + args.edge_weight * F.binary_cross_entropy(edge_prob, edge_gt)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        it += 1

        if it % args.log_interval == 0:
            print(f"iter {it}/{args.iters} lr {lr:.2e} loss {loss.item():.4f} grad_norm {grad_norm:.2f} "
                  f"scale {scaler.get_scale():.0f} {(time.time() - t0) / args.log_interval:.3f}s/it")
            t0 = time.time()
        if it % args.eval_interval == 0 or it == args.iters:
            miou, per_class = evaluate(model, val_loader, args.num_classes, args, device)
            print(f"iter {it}: mIoU {miou:.4f}")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "iter": it, "best_miou": max(miou, best_miou)}
            torch.save(state, os.path.join(args.out_dir, "last.pth"))
            if miou > best_miou:
                best_miou = miou
                torch.save(state, os.path.join(args.out_dir, "best.pth"))
    if args.export:
        export_onnx(model, os.path.join(args.out_dir, "segmodel_fp16.onnx"))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/cityscapes")
    p.add_argument("--out-dir", default="work_dirs/deeplabv3plus")
    p.add_argument("--num-classes", type=int, default=19)
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=80000)
    p.add_argument("--warmup-iters", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--aux-weight", type=float, default=0.4)
    p.add_argument("--edge-weight", type=float, default=0.2)
    p.add_argument("--ohem-thresh", type=float, default=0.7)
    p.add_argument("--ohem-min-kept", type=int, default=100000)
    p.add_argument("--clip-grad", type=float, default=10.0)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--eval-interval", type=int, default=4000)
    p.add_argument("--flip", action="store_true")
    p.add_argument("--export", action="store_true")
    p.add_argument("--resume", default="")
    return p.parse_args()


if __name__ == "__main__":
    args = get_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args)
