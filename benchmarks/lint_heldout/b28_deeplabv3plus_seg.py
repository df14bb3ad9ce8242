"""DeepLabV3+ (ResNet-50 backbone) for semantic segmentation.

Decoder with a squeeze-excite fusion block, an auxiliary boundary branch and an
image-level class-presence head. Trained with OHEM cross-entropy + Lovasz-Softmax.
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.models import ResNet50_Weights, resnet50
from torchvision.models._utils import IntermediateLayerGetter


def conv_bn_relu(in_ch, out_ch, k=3, dilation=1):
    pad = dilation * (k - 1) // 2
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, k, padding=pad, dilation=dilation, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


class ASPPPooling(nn.Sequential):
    def __init__(self, in_ch, out_ch):
        super().__init__(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(in_ch, out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )

    def forward(self, x):
        size = x.shape[-2:]
        for mod in self:
            x = mod(x)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class ASPP(nn.Module):
    def __init__(self, in_ch, out_ch=256, rates=(6, 12, 18)):
        super().__init__()
        branches = [conv_bn_relu(in_ch, out_ch, k=1)]
        for r in rates:
            branches.append(conv_bn_relu(in_ch, out_ch, k=3, dilation=r))
        branches.append(ASPPPooling(in_ch, out_ch))
        self.branches = nn.ModuleList(branches)
        self.project = nn.Sequential(
            nn.Conv2d(out_ch * len(branches), out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Dropout(0.1),
        )

    def forward(self, x):
        res = [branch(x) for branch in self.branches]
        return self.project(torch.cat(res, dim=1))


class SqueezeExcite(nn.Module):
    def __init__(self, ch, reduction=16):
        super().__init__()
        self.fc1 = nn.Conv2d(ch, ch // reduction, 1)
        self.fc2 = nn.Conv2d(ch // reduction, ch, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class Decoder(nn.Module):
    def __init__(self, low_ch, aspp_ch=256, low_proj=48, out_ch=256):
        super().__init__()
        self.low_proj = conv_bn_relu(low_ch, low_proj, k=1)
        self.fuse = nn.Conv2d(aspp_ch + low_proj, out_ch, 3, padding=1, bias=False)
        self.se = SqueezeExcite(out_ch)
        self.refine = nn.Sequential(conv_bn_relu(out_ch, out_ch), conv_bn_relu(out_ch, out_ch))
        self.edge_conv = nn.Conv2d(low_proj, 1, 3, padding=1)

    def forward(self, x, low):
        low = self.low_proj(low)
        x = F.interpolate(x, size=low.shape[-2:], mode="bilinear", align_corners=False)
        y = self.fuse(torch.cat([x, low], dim=1))
        y = self.se(y)
        edge_logits = self.edge_conv(low)
        # emphasise features near object boundaries
        edge = torch.sigmoid(edge_logits)
        edge = edge / (edge.amax(dim=(2, 3), keepdim=True) + 1e-8)  # expect: AMP011
        y = self.refine(y * (1.0 + edge))
        return y, edge_logits


class DeepLabV3Plus(nn.Module):
    def __init__(self, num_classes, pretrained=True):
        super().__init__()
        weights = ResNet50_Weights.IMAGENET1K_V2 if pretrained else None
        backbone = resnet50(weights=weights, replace_stride_with_dilation=[False, False, True])
        self.backbone = IntermediateLayerGetter(backbone, return_layers={"layer1": "low", "layer4": "out"})
        self.aspp = ASPP(2048, 256, rates=(6, 12, 18))
        self.decoder = Decoder(256)
        self.classifier = nn.Conv2d(256, num_classes, 1)
        self.cls_conv = nn.Conv2d(256, 256, 1)
        self.cls_fc = nn.Linear(256, num_classes)

    def forward(self, x):
        h, w = x.shape[-2:]
        feats = self.backbone(x)
        aspp_out = self.aspp(feats["out"])
        y, edge_logits = self.decoder(aspp_out, feats["low"])
        logits = F.interpolate(self.classifier(y), size=(h, w), mode="bilinear", align_corners=False)
        out = {
            "out": logits,
            "edge": F.interpolate(edge_logits, size=(h, w), mode="bilinear", align_corners=False),
        }
        if self.training:
            cls_feat = self.cls_conv(aspp_out)
            pooled = cls_feat.mean(dim=(2, 3))  # expect: AMP004
            out["presence"] = self.cls_fc(pooled)
        return out


# --------------------------------------------------------------------------- losses
def lovasz_grad(gt_sorted):
    p = len(gt_sorted)
    gts = gt_sorted.sum()
    intersection = gts - gt_sorted.cumsum(0)
    union = gts + (1.0 - gt_sorted).cumsum(0)
    jaccard = 1.0 - intersection / union
    if p > 1:
        jaccard[1:p] = jaccard[1:p] - jaccard[0:-1]
    return jaccard


def lovasz_softmax_flat(probas, labels, classes="present"):
    if probas.numel() == 0:
        return probas * 0.0
    num_classes = probas.size(1)
    losses = []
    for c in range(num_classes):
        fg = (labels == c).float()
        if classes == "present" and fg.sum() == 0:
            continue
        errors = (fg - probas[:, c]).abs()
        errors_sorted, perm = torch.sort(errors, 0, descending=True)
        losses.append(torch.dot(errors_sorted, lovasz_grad(fg[perm])))
    if not losses:
        return probas.sum() * 0.0
    return torch.stack(losses).mean()


def lovasz_softmax(logits, labels, ignore_index=255):
    probas = F.softmax(logits, dim=1)
    num_classes = probas.size(1)
    probas = probas.permute(0, 2, 3, 1).reshape(-1, num_classes)
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    return lovasz_softmax_flat(probas[valid], labels[valid])


class OhemCrossEntropy(nn.Module):
    def __init__(self, ignore_index=255, thresh=0.7, min_kept=100000):
        super().__init__()
        self.ignore_index = ignore_index
        self.thresh = -math.log(thresh)
        self.min_kept = min_kept

    def forward(self, logits, target):
        pixel_losses = F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="none").view(-1)
        pixel_losses = pixel_losses[target.view(-1) != self.ignore_index]
        n_min = min(self.min_kept, max(pixel_losses.numel() // 16, 1))
        hard = pixel_losses[pixel_losses > self.thresh]
        if hard.numel() < n_min:
            hard, _ = pixel_losses.topk(n_min)
        return hard.mean()


class SegCriterion(nn.Module):
    def __init__(self, num_classes, lovasz_weight=0.5, edge_weight=1.0, presence_weight=0.2, ignore_index=255):
        super().__init__()
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.ohem = OhemCrossEntropy(ignore_index=ignore_index)
        self.w = {"lovasz": lovasz_weight, "edge": edge_weight, "presence": presence_weight}

    def forward(self, outputs, target, edge_target):
        logits = outputs["out"]
        losses = {"ce": self.ohem(logits, target), "lovasz": lovasz_softmax(logits, target, self.ignore_index)}
        pos = edge_target.sum().clamp(min=1.0)
        pos_weight = (edge_target.numel() - pos) / pos
        losses["edge"] = F.binary_cross_entropy_with_logits(outputs["edge"].squeeze(1), edge_target, pos_weight=pos_weight)
        if "presence" in outputs:
            present = torch.zeros(target.size(0), self.num_classes, device=target.device)
            for b in range(target.size(0)):
                ids = target[b].unique()
                present[b, ids[ids != self.ignore_index]] = 1.0
            losses["presence"] = F.binary_cross_entropy_with_logits(outputs["presence"], present)
        total = losses["ce"]
        for name, weight in self.w.items():
            if name in losses:
                total = total + weight * losses[name]
        losses["total"] = total
        return losses


# --------------------------------------------------------------------------- data
class NpySegDataset(Dataset):
    def __init__(self, root, split):
        self.img_dir = os.path.join(root, split, "images")
        self.mask_dir = os.path.join(root, split, "masks")
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".npy"))

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = np.load(os.path.join(self.img_dir, self.names[i] + ".npy")).astype(np.float32) / 255.0
        mask = np.load(os.path.join(self.mask_dir, self.names[i] + ".npy")).astype(np.int64)
        edge = np.zeros(mask.shape, dtype=np.float32)
        edge[1:, :] += mask[1:, :] != mask[:-1, :]
        edge[:, 1:] += mask[:, 1:] != mask[:, :-1]
        return torch.from_numpy(img).permute(2, 0, 1), torch.from_numpy(mask), torch.from_numpy(np.minimum(edge, 1.0))


# --------------------------------------------------------------------------- train / eval
def train_one_epoch(model, criterion, loader, optimizer, scheduler, scaler, device, epoch, use_amp=True, clip_norm=None):
    model.train()
    for i, (images, masks, edges) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        masks = masks.to(device, non_blocking=True)
        edges = edges.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
            outputs = model(images)
            losses = criterion(outputs, masks, edges)
        scaler.scale(losses["total"]).backward()
        if clip_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if i % 50 == 0:
            with torch.no_grad():
                logp = F.log_softmax(outputs["out"].float(), dim=1)
                entropy = -(logp.exp() * logp).sum(1).mean()
            print(f"epoch {epoch} it {i} loss {losses['total'].item():.4f} "
                  f"ce {losses['ce'].item():.4f} lovasz {losses['lovasz'].item():.4f} H {entropy.item():.3f} "
                  f"scale {scaler.get_scale():.0f}")


@torch.inference_mode()
def evaluate(model, loader, num_classes, device, use_amp=True, ignore_index=255):
    model.eval()
    hist = np.zeros((num_classes, num_classes), dtype=np.int64)
    for images, masks, _ in loader:
        images = images.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
            logits = model(images)["out"]
        pred = logits.float().argmax(1).cpu().numpy().ravel()
        gt = masks.numpy().ravel()
        keep = gt != ignore_index
        hist += np.bincount(num_classes * gt[keep] + pred[keep], minlength=num_classes ** 2).reshape(num_classes, num_classes)
    iou = np.diag(hist) / (hist.sum(1) + hist.sum(0) - np.diag(hist) + 1e-10)
    return float(np.nanmean(iou)), iou


def export_half_checkpoint(model, path):
    state = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save({"model": state, "dtype": "float16"}, path)


def export_onnx(model, path, size=(512, 1024)):
    m = copy.deepcopy(model).eval().half()
    dummy = torch.randn(1, 3, *size, device="cuda", dtype=torch.float16)
    torch.onnx.export(m, dummy, path, input_names=["image"], output_names=["out"], opset_version=17)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/cityscapes_npy")
    parser.add_argument("--num-classes", type=int, default=19)
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--no-amp", action="store_true")
    parser.add_argument("--out", default="runs/deeplabv3plus")
    args = parser.parse_args()
    use_amp = not args.no_amp
    device = torch.device("cuda")

    train_loader = DataLoader(NpySegDataset(args.data, "train"), batch_size=args.batch_size, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(NpySegDataset(args.data, "val"), batch_size=1, num_workers=4)

    model = DeepLabV3Plus(args.num_classes).to(device)
    criterion = SegCriterion(args.num_classes)
    backbone_params = list(model.backbone.parameters())
    head_params = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.SGD([{"params": backbone_params, "lr": args.lr},
                                 {"params": head_params, "lr": args.lr * 10}],
                                lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    total_iters = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / total_iters) ** 0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)

    os.makedirs(args.out, exist_ok=True)
    best_miou = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, optimizer, scheduler, scaler, device, epoch,
                        use_amp=use_amp, clip_norm=args.clip)
        miou, _ = evaluate(model, val_loader, args.num_classes, device, use_amp=use_amp)
        print(f"epoch {epoch}: mIoU {miou:.4f}")
        if miou > best_miou:
            best_miou = miou
            torch.save({"model": model.state_dict(), "epoch": epoch, "miou": miou}, os.path.join(args.out, "best.pth"))
    export_half_checkpoint(model, os.path.join(args.out, "final_fp16.pth"))
    export_onnx(model, os.path.join(args.out, "deeplabv3plus.onnx"))


if __name__ == "__main__":
    main()
