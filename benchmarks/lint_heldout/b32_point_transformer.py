"""Point cloud transformer for part segmentation / shape classification.

Local kNN attention with a PointMLP-style geometric affine on grouped
features, farthest point sampling between stages.  Trained with DDP under
fp16 autocast; an optional masked-point pretraining entry point reconstructs
dropped patches (Chamfer distance).
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from pcdata import ShapeNetPartDataset


@torch.no_grad()
def farthest_point_sample(xyz, npoint):
    b, n, _ = xyz.shape
    centroids = torch.zeros(b, npoint, dtype=torch.long, device=xyz.device)
    distance = torch.ones(b, n, device=xyz.device) * 1e10
    farthest = torch.randint(0, n, (b,), dtype=torch.long, device=xyz.device)
    batch_idx = torch.arange(b, dtype=torch.long, device=xyz.device)
    for i in range(npoint):
        centroids[:, i] = farthest
        centroid = xyz[batch_idx, farthest, :].view(b, 1, 3)
        d = torch.sum((xyz - centroid) ** 2, -1)
        distance = torch.minimum(distance, d)
        farthest = torch.max(distance, -1)[1]
    return centroids


def knn(xyz, k):
    return torch.cdist(xyz, xyz).topk(k, dim=-1, largest=False)[1]


def gather(points, idx):
    b = points.shape[0]
    batch_idx = torch.arange(b, device=points.device).view(b, *([1] * (idx.dim() - 1)))
    return points[batch_idx, idx]


class GeometricAffine(nn.Module):
    """PointMLP's normalisation of grouped neighbour features."""

    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, 1, 1, channels))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, channels))

    def forward(self, feats, knn_idx):
        b, n, k = knn_idx.shape
        batch_idx = torch.arange(b, device=feats.device).view(b, 1, 1)
        grouped = feats[batch_idx, knn_idx]
        anchor = grouped.mean(dim=2, keepdim=True)  # expect: AMP004
        centred = grouped - anchor
        std = centred.reshape(b, -1).std(dim=-1, keepdim=True)  # expect: AMP004
        grouped = centred / (std.view(b, 1, 1, 1) + 1e-8)  # expect: AMP011
        return self.alpha * grouped + self.beta


class LocalAttention(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.pos_mlp = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, dim))
        self.out = nn.Linear(dim, dim)

    def forward(self, center, local, rel_xyz, pad_mask=None):
        b, n, k, c = local.shape
        h = self.heads
        q = self.to_q(center).view(b, n, h, 1, c // h)
        kv = self.to_kv(local) + self.pos_mlp(rel_xyz).repeat(1, 1, 1, 2)
        k_, v = kv.view(b, n, k, 2, h, c // h).permute(3, 0, 1, 4, 2, 5).unbind(0)
        logits = (q @ k_.transpose(-1, -2)).squeeze(-2) * self.scale
        if pad_mask is not None:
            logits = logits.masked_fill(~pad_mask[:, :, None, :], -1e9)  # expect: AMP007
        attn = logits.softmax(dim=-1)
        out = (attn.unsqueeze(-2) @ v).squeeze(-2).reshape(b, n, c)
        return self.out(out)


class PointStage(nn.Module):
    def __init__(self, in_ch, out_ch, k=16, npoint=None):
        super().__init__()
        self.k, self.npoint = k, npoint
        self.proj = nn.Linear(in_ch, out_ch)
        self.affine = GeometricAffine(out_ch)
        self.attn = LocalAttention(out_ch)
        self.ffn = nn.Sequential(nn.Linear(out_ch, 2 * out_ch), nn.GELU(), nn.Linear(2 * out_ch, out_ch))

    def forward(self, xyz, feats, pad_mask=None):
        if self.npoint is not None:
            idx = farthest_point_sample(xyz, self.npoint)
            xyz, feats = gather(xyz, idx), gather(feats, idx)
            pad_mask = None if pad_mask is None else gather(pad_mask, idx)
        knn_idx = knn(xyz, self.k)
        feats = self.proj(feats)
        local = self.affine(feats, knn_idx)
        rel_xyz = gather(xyz, knn_idx) - xyz.unsqueeze(2)
        nbr_mask = None if pad_mask is None else gather(pad_mask, knn_idx)
        feats = feats + self.attn(feats, local, rel_xyz, nbr_mask)
        return xyz, feats + self.ffn(feats), pad_mask


class PointBackbone(nn.Module):
    def __init__(self, in_ch=6, dims=(64, 128, 256, 512), npoints=(None, 512, 256, 128), k=16):
        super().__init__()
        chans = (in_ch,) + tuple(dims)
        self.stages = nn.ModuleList(
            [PointStage(chans[i], chans[i + 1], k, npoints[i]) for i in range(len(dims))]
        )
        self.out_proj = nn.Linear(dims[-1], dims[-1])

    def forward(self, xyz, feats, pad_mask=None):
        for stage in self.stages:
            xyz, feats, pad_mask = stage(xyz, feats, pad_mask)
        return self.out_proj(feats)


class ShapeHead(nn.Module):
    def __init__(self, dim, num_classes):
        super().__init__()
        self.cls = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, num_classes))
        self.objectness = nn.Linear(dim, 1)
        self.normals = nn.Linear(dim, 3)

    def forward(self, feats):
        pooled = torch.cat([feats.mean(dim=1), feats.amax(dim=1)], dim=-1)  # expect: AMP004
        return {
            "logits": self.cls(pooled),
            "objectness": torch.sigmoid(self.objectness(feats)).squeeze(-1),
            "normals": F.normalize(self.normals(feats), dim=-1),
        }


def build_model(cfg):
    backbone = PointBackbone(in_ch=cfg.in_ch, k=cfg.k)
    head = ShapeHead(512, cfg.num_classes)
    return backbone, head


def chamfer_loss(pred, gt):
    d = torch.cdist(pred, gt)
    return d.min(dim=2)[0].mean() + d.min(dim=1)[0].mean()


def pretrain(cfg, loader):
    backbone, _ = build_model(cfg)
    backbone.cuda()
    decoder = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 32 * 3)).cuda()
    params = list(backbone.parameters()) + list(decoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.05)
    for epoch in range(cfg.pretrain_epochs):
        for xyz, feats, patches in loader:
            xyz, feats, patches = xyz.cuda(), feats.cuda(), patches.cuda()
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                tokens = backbone(xyz, feats)
                recon = decoder(tokens).view(*tokens.shape[:2], 32, 3)
            loss = chamfer_loss(recon.flatten(0, 1), patches.flatten(0, 1))  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def train(cfg, rank, world_size):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    backbone, head = build_model(cfg)
    backbone = DDP(backbone.cuda(), device_ids=[rank])
    head = DDP(head.cuda(), device_ids=[rank])
    params = list(backbone.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    scaler = torch.amp.GradScaler("cuda")
    obj_criterion = nn.BCELoss()
    dataset = ShapeNetPartDataset(cfg.data_root, split="trainval", npoints=cfg.npoints)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, num_workers=8, drop_last=True)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for xyz, feats, pad_mask, label, obj_target, normals in loader:
            xyz, feats, pad_mask = xyz.cuda(), feats.cuda(), pad_mask.cuda()
            label, obj_target, normals = label.cuda(), obj_target.cuda(), normals.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                out = head(backbone(xyz, feats, pad_mask))
                cls_loss = F.cross_entropy(out["logits"], label, label_smoothing=0.1)
                obj_loss = obj_criterion(out["objectness"], obj_target)  # expect: AMP003
                normal_loss = (1.0 - (out["normals"] * normals).sum(-1).abs()).mean()
                loss = cls_loss + 0.5 * obj_loss + 0.1 * normal_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        if rank == 0:
            torch.save({"backbone": backbone.module.state_dict(), "head": head.module.state_dict(),
                        "epoch": epoch}, os.path.join(cfg.out_dir, f"epoch_{epoch:03d}.pt"))
    dist.destroy_process_group()


def _worker(rank, cfg, world_size):
    train(cfg, rank, world_size)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Point transformer training")
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--out-dir", default="runs/pct")
    parser.add_argument("--in-ch", type=int, default=6)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--num-classes", type=int, default=16)
    parser.add_argument("--npoints", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--clip", type=float, default=10.0)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--pretrain", action="store_true")
    parser.add_argument("--pretrain-epochs", type=int, default=100)
    cfg = parser.parse_args()
    os.makedirs(cfg.out_dir, exist_ok=True)
    if cfg.pretrain:
        patches = ShapeNetPartDataset(cfg.data_root, split="all", npoints=cfg.npoints, return_patches=True)
        pretrain(cfg, DataLoader(patches, batch_size=cfg.batch_size, shuffle=True, num_workers=8, drop_last=True))
    else:
        world_size = torch.cuda.device_count()
        torch.multiprocessing.spawn(_worker, args=(cfg, world_size), nprocs=world_size)
