"""Semi-supervised semantic segmentation: FixMatch-style weak/strong consistency with a
mean-teacher EMA model and an auxiliary boundary head."""
import argparse
import copy
import logging
import os
import random

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from backbones import resnet101
from datasets.semi import SemiDataset
from utils.eval import intersection_and_union

logger = logging.getLogger("semiseg")


class ASPP(nn.Module):
    def __init__(self, in_ch, out_ch, rates=(6, 12, 18)):
        super().__init__()
        self.b0 = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU(True))
        self.branches = nn.ModuleList([
            nn.Sequential(nn.Conv2d(in_ch, out_ch, 3, padding=r, dilation=r, bias=False),
                          nn.BatchNorm2d(out_ch), nn.ReLU(True))
            for r in rates
        ])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(in_ch, out_ch, 1, bias=False), nn.ReLU(True))
        self.project = nn.Sequential(nn.Conv2d(out_ch * (len(rates) + 2), out_ch, 1, bias=False),
                                     nn.BatchNorm2d(out_ch), nn.ReLU(True))

    def forward(self, x):
        h, w = x.shape[-2:]
        feats = [self.b0(x)] + [b(x) for b in self.branches]
        feats.append(F.interpolate(self.pool(x), size=(h, w), mode="bilinear", align_corners=True))
        return self.project(torch.cat(feats, dim=1))


class FeatureDrop(nn.Module):
    """Drop the most activated regions of a feature map (CCT-style perturbation)."""

    def __init__(self, lower=0.7, upper=0.9):
        super().__init__()
        self.lower = lower
        self.upper = upper

    def forward(self, x):
        attention = torch.mean(x, dim=1, keepdim=True)  # expect: AMP004
        max_val, _ = torch.max(attention.view(x.size(0), -1), dim=1, keepdim=True)
        threshold = max_val * np.random.uniform(self.lower, self.upper)
        threshold = threshold.view(x.size(0), 1, 1, 1).expand_as(attention)
        drop_mask = (attention < threshold).to(x.dtype)
        return x * drop_mask


class DeepLabV3Plus(nn.Module):
    def __init__(self, num_classes, pretrained=True):
        super().__init__()
        self.backbone = resnet101(pretrained=pretrained, replace_stride_with_dilation=[False, False, True])
        self.aspp = ASPP(2048, 256)
        self.reduce = nn.Sequential(nn.Conv2d(256, 48, 1, bias=False), nn.BatchNorm2d(48), nn.ReLU(True))
        self.fuse = nn.Sequential(
            nn.Conv2d(304, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
            nn.Conv2d(256, 256, 3, padding=1, bias=False),
        )
        self.feature_drop = FeatureDrop()
        self.classifier = nn.Conv2d(256, num_classes, 1)
        self.edge_head = nn.Conv2d(256, 1, 1)

    def forward(self, x, perturb=False):
        h, w = x.shape[-2:]
        c1, _, _, c4 = self.backbone.base_forward(x)
        c4 = self.aspp(c4)
        c4 = F.interpolate(c4, size=c1.shape[-2:], mode="bilinear", align_corners=True)
        feat = F.relu(self.fuse(torch.cat([self.reduce(c1), c4], dim=1)))
        if perturb:
            feat = self.feature_drop(feat)
        logits = F.interpolate(self.classifier(feat), size=(h, w), mode="bilinear", align_corners=True)
        edge = F.interpolate(self.edge_head(feat), size=(h, w), mode="bilinear", align_corners=True)
        return logits, edge


@torch.no_grad()
def update_ema(teacher, student, momentum):
    for t_p, s_p in zip(teacher.parameters(), student.parameters()):
        t_p.mul_(momentum).add_(s_p.detach(), alpha=1 - momentum)
    for t_b, s_b in zip(teacher.buffers(), student.buffers()):
        t_b.copy_(s_b)


def edge_targets(mask, ignore_index=255):
    m = mask.clone().float()
    m[mask == ignore_index] = 0
    dil = F.max_pool2d(m[:, None], 3, stride=1, padding=1)
    ero = -F.max_pool2d(-m[:, None], 3, stride=1, padding=1)
    return (dil != ero).float()


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    inter = torch.zeros(num_classes, device=device)
    union = torch.zeros(num_classes, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = model(img)
        pred = logits.argmax(dim=1)
        i, u = intersection_and_union(pred, mask, num_classes, ignore_index=255)
        inter += i
        union += u
    model.train()
    return (inter / (union + 1e-10)).mean().item()


def warmup_supervised(model, loader, device, iters, lr):
    """A few supervised iterations so the teacher starts from something sensible."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    ce = nn.CrossEntropyLoss(ignore_index=255)
    it = 0
    while it < iters:
        for img, mask in loader:
            img, mask = img.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, _ = model(img)
                loss = ce(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # expect: AMP006
            it += 1
            if it >= iters:
                break


def train(args):
    device = torch.device("cuda")
    model = DeepLabV3Plus(args.num_classes).to(device)
    teacher = copy.deepcopy(model)
    teacher.requires_grad_(False)
    teacher.eval()

    head_lr = [p for n, p in model.named_parameters() if not n.startswith("backbone")]
    optimizer = torch.optim.SGD(
        [{"params": model.backbone.parameters(), "lr": args.lr},
         {"params": head_lr, "lr": args.lr * 10}],
        lr=args.lr, momentum=0.9, weight_decay=1e-4,
    )
    scaler = torch.amp.GradScaler("cuda")
    ce_l = nn.CrossEntropyLoss(ignore_index=255)
    ce_u = nn.CrossEntropyLoss(ignore_index=255, reduction="none")

    trainset_l = SemiDataset(args.dataset, args.data_root, "train_l", args.crop_size, args.labeled_id_path)
    trainset_u = SemiDataset(args.dataset, args.data_root, "train_u", args.crop_size, args.unlabeled_id_path)
    valset = SemiDataset(args.dataset, args.data_root, "val")
    loader_l = DataLoader(trainset_l, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    loader_u = DataLoader(trainset_u, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(valset, batch_size=1, num_workers=2)

    if args.warmup_iters > 0:
        warmup_supervised(model, loader_l, device, args.warmup_iters, args.lr)
        teacher.load_state_dict(model.state_dict())

    total_iters = len(loader_u) * args.epochs
    best_miou = 0.0
    it = 0
    for epoch in range(args.epochs):
        for (img_x, mask_x), (img_u_w, img_u_s, ignore_mask, cutmix_box) in zip(loader_l, loader_u):
            img_x, mask_x = img_x.to(device), mask_x.to(device)
            img_u_w, img_u_s = img_u_w.to(device), img_u_s.to(device)
            ignore_mask, cutmix_box = ignore_mask.to(device), cutmix_box.to(device)

            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                t_logits, t_edge = teacher(img_u_w)
                t_prob = t_logits.float().softmax(dim=1)
                conf_u, mask_u = t_prob.max(dim=1)
                t_edge_prob = torch.sigmoid(t_edge.float())

            with torch.autocast("cuda", dtype=torch.float16):
                logits_x, edge_x = model(img_x)
                loss_x = ce_l(logits_x, mask_x)
                loss_edge_x = F.binary_cross_entropy_with_logits(edge_x, edge_targets(mask_x))

                logits_s, edge_s = model(img_u_s, perturb=True)
                loss_u = ce_u(logits_s, mask_u)
                valid = ((conf_u >= args.conf_thresh) & (ignore_mask != 255)).float()
                loss_u = (loss_u * valid).sum() / (ignore_mask != 255).sum().clamp(min=1)

                s_prob = logits_s.softmax(dim=1)
                ent = -(s_prob * torch.log(s_prob + 1e-8)).sum(dim=1).mean()

                loss_edge_u = F.binary_cross_entropy(torch.sigmoid(edge_s), t_edge_prob)  # expect: AMP003
                loss = (loss_x + args.edge_weight * loss_edge_x + args.lambda_u * loss_u
                        + args.edge_weight * loss_edge_u + args.ent_weight * ent)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()

            lr = args.lr * (1 - it / total_iters) ** 0.9
            optimizer.param_groups[0]["lr"] = lr
            optimizer.param_groups[1]["lr"] = lr * 10
            update_ema(teacher, model, min(1 - 1 / (it + 1), args.ema))
            it += 1

            if it % 20 == 0:
                logger.info("it %d loss %.3f x %.3f u %.3f ratio %.3f gnorm %.2f", it, loss.item(),
                            loss_x.item(), loss_u.item(), valid.mean().item(), grad_norm.item())

        miou = evaluate(teacher, val_loader, args.num_classes, device)
        logger.info("epoch %d teacher mIoU %.2f", epoch, miou * 100)
        if miou > best_miou:
            best_miou = miou
            torch.save({"model": model.state_dict(), "teacher": teacher.state_dict(), "epoch": epoch},
                       os.path.join(args.save_path, "best.pth"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="pascal")
    p.add_argument("--data-root", required=True)
    p.add_argument("--labeled-id-path", required=True)
    p.add_argument("--unlabeled-id-path", required=True)
    p.add_argument("--save-path", default="exp/semiseg")
    p.add_argument("--num-classes", type=int, default=21)
    p.add_argument("--crop-size", type=int, default=513)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-iters", type=int, default=0)
    p.add_argument("--conf-thresh", type=float, default=0.95)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--edge-weight", type=float, default=0.5)
    p.add_argument("--ent-weight", type=float, default=0.0)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--clip", type=float, default=5.0)
    args = p.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    os.makedirs(args.save_path, exist_ok=True)
    logging.basicConfig(level=logging.INFO)
    train(args)


if __name__ == "__main__":
    main()
