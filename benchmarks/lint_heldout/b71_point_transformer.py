"""Point Transformer classifier for ModelNet40 / ScanObjectNN.

Vector self-attention over k-NN neighbourhoods, transition-down stages with
farthest point sampling and PointMLP-style geometric affine normalisation of the
grouped features, a PCT offset-attention layer on the coarsest level and a
max+mean pooled classification head. Trains with bf16 autocast (no loss scaling).
"""
import argparse
import logging
import os
import time

import numpy as np
import torch as th
import torch.nn as nn
import torch.nn.functional as F

from pointcloud.datasets import ModelNet40, ScanObjectNN
from pointcloud.transforms import PointcloudScaleAndTranslate
from pointcloud.utils import AverageMeter, set_seed

logger = logging.getLogger("pct")

CONFIGS = {
    "pt_cls": {"dims": [32, 64, 128, 256, 512], "points": [1024, 512, 256, 64, 16], "blocks": [1, 1, 1, 1, 1],
               "k": 16, "act": "ReLU", "affine": True},
    "pt_cls_lite": {"dims": [32, 64, 128, 256], "points": [1024, 256, 64, 16], "blocks": [1, 1, 1, 1],
                    "k": 16, "act": "GELU", "affine": False},
}


@th.no_grad()
def farthest_point_sample(xyz, npoint):
    B, N, _ = xyz.shape
    centroids = th.zeros(B, npoint, dtype=th.long, device=xyz.device)
    distance = th.ones(B, N, device=xyz.device) * 1e10
    farthest = th.randint(0, N, (B,), dtype=th.long, device=xyz.device)
    batch_indices = th.arange(B, dtype=th.long, device=xyz.device)
    for i in range(npoint):
        centroids[:, i] = farthest
        centroid = xyz[batch_indices, farthest, :].view(B, 1, 3)
        dist = th.sum((xyz - centroid) ** 2, -1)
        distance = th.min(distance, dist)
        farthest = th.max(distance, -1)[1]
    return centroids


@th.no_grad()
def knn_query(k, xyz, new_xyz):
    dist = th.cdist(new_xyz.float(), xyz.float())
    return dist.topk(k, dim=-1, largest=False)[1]


def gather_points(points, idx):
    B = points.shape[0]
    view_shape = [B] + [1] * (idx.dim() - 1)
    batch = th.arange(B, device=points.device).view(view_shape).expand_as(idx)
    return points[batch, idx]


class PointTransformerLayer(nn.Module):
    def __init__(self, dim, k=16, pos_hidden=64, attn_mult=4):
        super().__init__()
        self.k = k
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.pos_mlp = nn.Sequential(nn.Linear(3, pos_hidden), nn.ReLU(inplace=True), nn.Linear(pos_hidden, dim))
        self.attn_mlp = nn.Sequential(nn.Linear(dim, dim * attn_mult), nn.ReLU(inplace=True),
                                      nn.Linear(dim * attn_mult, dim))

    def forward(self, xyz, feats):
        idx = knn_query(self.k, xyz, xyz)
        q, k, v = self.to_qkv(feats).chunk(3, dim=-1)
        rel = xyz.unsqueeze(2) - gather_points(xyz, idx)
        pos = self.pos_mlp(rel)
        attn = self.attn_mlp(q.unsqueeze(2) - gather_points(k, idx) + pos)
        attn = attn.softmax(dim=2)
        return th.sum(attn * (gather_points(v, idx) + pos), dim=2)


class PointTransformerBlock(nn.Module):
    def __init__(self, dim, k=16):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.attn = PointTransformerLayer(dim, k)
        self.fc2 = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, xyz, feats):
        h = F.relu(self.fc1(feats))
        h = self.fc2(self.attn(xyz, h))
        return F.relu(self.norm(h + feats))


class TransitionDown(nn.Module):
    """FPS + kNN grouping, lift with a shared linear, geometric affine, max-pool."""

    def __init__(self, in_dim, out_dim, npoint, k=16, affine=True):
        super().__init__()
        self.npoint, self.k = npoint, k
        self.lift = nn.Linear(in_dim + 3, out_dim, bias=False)
        self.affine = affine
        if affine:
            self.affine_alpha = nn.Parameter(th.ones(1, 1, 1, out_dim))
            self.affine_beta = nn.Parameter(th.zeros(1, 1, 1, out_dim))
        self.out_proj = nn.Linear(out_dim, out_dim)

    def forward(self, xyz, feats):
        B = xyz.shape[0]
        fps_idx = farthest_point_sample(xyz, self.npoint)
        new_xyz = gather_points(xyz, fps_idx)
        idx = knn_query(self.k, xyz, new_xyz)
        grouped_xyz = gather_points(xyz, idx) - new_xyz.unsqueeze(2)
        grouped = self.lift(th.cat([grouped_xyz, gather_points(feats, idx)], dim=-1))
        if self.affine:
            mean = grouped.mean(dim=2, keepdim=True)  # expect: AMP004
            std = (grouped - mean).reshape(B, -1).std(dim=-1, keepdim=True)  # expect: AMP004
            grouped = self.affine_alpha * (grouped - mean) / (std.view(B, 1, 1, 1) + 1e-5) + self.affine_beta
        pooled = grouped.max(dim=2)[0]
        return new_xyz, self.out_proj(F.relu(pooled))


class OffsetAttention(nn.Module):
    """PCT offset-attention on (B, C, N) features."""

    def __init__(self, dim):
        super().__init__()
        self.q_conv = nn.Conv1d(dim, dim // 4, 1, bias=False)
        self.k_conv = nn.Conv1d(dim, dim // 4, 1, bias=False)
        self.k_conv.weight = self.q_conv.weight
        self.v_conv = nn.Conv1d(dim, dim, 1)
        self.trans_conv = nn.Conv1d(dim, dim, 1)
        self.after_norm = nn.BatchNorm1d(dim)

    def forward(self, x):
        x_q = self.q_conv(x).permute(0, 2, 1)
        x_k = self.k_conv(x)
        energy = th.bmm(x_q, x_k)
        attention = energy.softmax(dim=-1)
        attention = attention / (1e-9 + attention.sum(dim=1, keepdim=True))
        x_r = th.bmm(self.v_conv(x), attention)
        x_r = F.relu(self.after_norm(self.trans_conv(x - x_r)))
        return x + x_r


class PointTransformerCls(nn.Module):
    def __init__(self, cfg, num_classes=40):
        super().__init__()
        dims, k = cfg["dims"], cfg["k"]
        self.embed = nn.Sequential(nn.Linear(3, dims[0]), getattr(nn, cfg["act"])(), nn.Linear(dims[0], dims[0]))
        self.enc0 = nn.ModuleList([PointTransformerBlock(dims[0], k) for _ in range(cfg["blocks"][0])])
        self.downs = nn.ModuleList(
            [TransitionDown(dims[i - 1], dims[i], cfg["points"][i], k, cfg["affine"]) for i in range(1, len(dims))]
        )
        self.stage_blocks = nn.ModuleList(
            [nn.ModuleList([PointTransformerBlock(dims[i], k) for _ in range(cfg["blocks"][i])])
             for i in range(1, len(dims))]
        )
        self.global_attn = OffsetAttention(dims[-1])
        self.fuse = nn.Linear(dims[-1], dims[-1] * 2)
        self.head = nn.Sequential(
            nn.Linear(dims[-1] * 4, 256), nn.BatchNorm1d(256), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(256, num_classes),
        )

    def forward(self, xyz):
        feats = self.embed(xyz)
        for blk in self.enc0:
            feats = blk(xyz, feats)
        for down, blocks in zip(self.downs, self.stage_blocks):
            xyz, feats = down(xyz, feats)
            for blk in blocks:
                feats = blk(xyz, feats)
        feats = self.global_attn(feats.transpose(1, 2)).transpose(1, 2)
        g = self.fuse(feats)
        g_max = g.max(dim=1)[0]
        g_avg = g.mean(dim=1)  # expect: AMP004
        return self.head(th.cat([g_max, g_avg], dim=-1))


MODEL_ZOO = {
    "pt_cls": lambda cfg, **kw: PointTransformerCls(cfg, **kw),
    "pt_cls_lite": PointTransformerCls,
}


class SmoothCrossEntropy(nn.Module):
    def __init__(self, smoothing=0.2):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits, target):
        n_class = logits.size(1)
        one_hot = th.zeros_like(logits, dtype=th.float32).scatter(1, target.view(-1, 1), 1.0)
        one_hot = one_hot * (1 - self.smoothing) + (1 - one_hot) * self.smoothing / (n_class - 1)
        log_prb = F.log_softmax(logits, dim=1)
        return -(one_hot * log_prb).sum(dim=1).mean()


def train_one_epoch(model, criterion, loader, optimizer, scheduler, augment, device, epoch, args):
    model.train()
    loss_meter, acc_meter = AverageMeter(), AverageMeter()
    t0 = time.time()
    for i, (xyz, label) in enumerate(loader):
        xyz = augment(xyz.to(device, non_blocking=True).float())
        label = label.to(device, non_blocking=True).view(-1)
        optimizer.zero_grad(set_to_none=True)
        with th.autocast(device_type="cuda", dtype=th.bfloat16):
            logits = model(xyz)
            loss = criterion(logits, label)
        loss.backward()
        th.nn.utils.clip_grad_norm_(model.parameters(), max_norm=args.clip)
        optimizer.step()
        acc = (logits.argmax(dim=1) == label).float().mean()
        loss_meter.update(loss.item(), xyz.size(0))
        acc_meter.update(acc.item(), xyz.size(0))
        if i % args.print_freq == 0:
            logger.info("epoch %d [%d/%d] loss %.4f acc %.3f logit-std %.3f (%.1fs)", epoch, i, len(loader),
                        loss_meter.avg, acc_meter.avg, logits.detach().float().std().item(), time.time() - t0)
    scheduler.step()
    return loss_meter.avg, acc_meter.avg


@th.no_grad()
def evaluate(model, loader, device, num_classes, votes=1):
    model.eval()
    correct = np.zeros(num_classes)
    total = np.zeros(num_classes)
    for xyz, label in loader:
        xyz, label = xyz.to(device).float(), label.to(device).view(-1)
        probs = 0
        for _ in range(votes):
            with th.autocast(device_type="cuda", dtype=th.bfloat16):
                logits = model(xyz)
            probs = probs + logits.float().softmax(dim=-1)
        pred = probs.argmax(dim=-1)
        for c in range(num_classes):
            m = label == c
            total[c] += m.sum().item()
            correct[c] += (pred[m] == c).sum().item()
    oa = correct.sum() / max(total.sum(), 1)
    macc = np.mean(correct[total > 0] / total[total > 0])
    return oa, macc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="modelnet40", choices=["modelnet40", "scanobjectnn"])
    p.add_argument("--arch", default="pt_cls", choices=list(MODEL_ZOO))
    p.add_argument("--num-points", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--smoothing", type=float, default=0.2)
    p.add_argument("--print-freq", type=int, default=20)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="ckpt/pt")
    args = p.parse_args()
    set_seed(args.seed)
    device = th.device("cuda")

    ds_cls = ModelNet40 if args.dataset == "modelnet40" else ScanObjectNN
    train_set = ds_cls(split="train", num_points=args.num_points)
    test_set = ds_cls(split="test", num_points=args.num_points)
    train_loader = th.utils.data.DataLoader(train_set, args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    test_loader = th.utils.data.DataLoader(test_set, args.batch_size, shuffle=False, num_workers=8)

    cfg = CONFIGS[args.arch]
    model = MODEL_ZOO[args.arch](cfg, num_classes=train_set.num_classes).to(device)
    criterion = SmoothCrossEntropy(args.smoothing)
    optimizer = th.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = th.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs, eta_min=args.lr / 100)
    augment = PointcloudScaleAndTranslate()

    os.makedirs(args.out, exist_ok=True)
    best_oa = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, optimizer, scheduler, augment, device, epoch, args)
        oa, macc = evaluate(model, test_loader, device, train_set.num_classes)
        if oa > best_oa:
            best_oa = oa
            th.save({"model": model.state_dict(), "epoch": epoch, "oa": oa}, os.path.join(args.out, "best.pth"))
        logger.info("epoch %d OA %.4f mAcc %.4f best %.4f", epoch, oa, macc, best_oa)


if __name__ == "__main__":
    main()
