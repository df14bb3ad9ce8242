"""PointNet++ (SSG) for ModelNet40 classification, with PointMLP's geometric affine
module in the grouping step.  Pure-PyTorch farthest point sampling and ball query;
distributed training with DDP and torch.compile.
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def square_distance(src, dst):
    """Squared distances [B, N, M].  The two norm terms are fp32, so the sum promotes."""
    inner = -2 * torch.matmul(src, dst.transpose(1, 2))
    return inner + src.pow(2).sum(-1, keepdim=True) + dst.pow(2).sum(-1).unsqueeze(1)


def index_points(points, idx):
    b = points.shape[0]
    view_shape = [b] + [1] * (idx.dim() - 1)
    batch_idx = torch.arange(b, device=points.device).view(view_shape).expand_as(idx)
    return points[batch_idx, idx]


@torch.no_grad()
def farthest_point_sample(xyz, npoint):
    b, n, _ = xyz.shape
    centroids = torch.zeros(b, npoint, dtype=torch.long, device=xyz.device)
    distance = torch.ones(b, n, device=xyz.device) * 1e10
    farthest = torch.randint(0, n, (b,), dtype=torch.long, device=xyz.device)
    batch = torch.arange(b, dtype=torch.long, device=xyz.device)
    for i in range(npoint):
        centroids[:, i] = farthest
        centroid = xyz[batch, farthest].view(b, 1, 3)
        d = torch.sum((xyz - centroid) ** 2, -1)
        closer = d < distance
        distance[closer] = d[closer]
        farthest = torch.max(distance, -1)[1]
    return centroids


@torch.no_grad()
def query_ball_point(radius, nsample, xyz, new_xyz):
    b, n, _ = xyz.shape
    s = new_xyz.shape[1]
    group_idx = torch.arange(n, dtype=torch.long, device=xyz.device).view(1, 1, n).repeat(b, s, 1)
    sqrdists = square_distance(new_xyz, xyz)
    group_idx[sqrdists > radius ** 2] = n
    group_idx = group_idx.sort(dim=-1)[0][:, :, :nsample]
    first = group_idx[:, :, :1].expand(-1, -1, nsample)
    pad = group_idx == n
    group_idx[pad] = first[pad]
    return group_idx


def shared_mlp(c_in, widths):
    layers = []
    for w in widths[:-1]:
        layers += [nn.Conv2d(c_in, w, 1), nn.GroupNorm(8, w), nn.ReLU(inplace=True)]
        c_in = w
    layers.append(nn.Conv2d(c_in, widths[-1], 1))
    return nn.Sequential(*layers)


class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, nsample, c_in, widths, pool="max", affine=True, center="anchor"):
        super().__init__()
        self.npoint, self.radius, self.nsample = npoint, radius, nsample
        self.pool, self.affine, self.center = pool, affine, center
        if affine:
            self.alpha = nn.Parameter(torch.ones(1, 1, 1, c_in))
            self.beta = nn.Parameter(torch.zeros(1, 1, 1, c_in))
        self.mlp = shared_mlp(c_in + 3, widths)

    def forward(self, xyz, feats):
        # xyz: [B, N, 3] fp32 coordinates; feats: [B, N, C] point features
        b = xyz.shape[0]
        fps_idx = farthest_point_sample(xyz, self.npoint)
        new_xyz = index_points(xyz, fps_idx)
        idx = query_ball_point(self.radius, self.nsample, xyz, new_xyz)
        grouped_xyz = (index_points(xyz, idx) - new_xyz.unsqueeze(2)) / self.radius
        grouped = index_points(feats, idx)
        if self.affine:
            if self.center == "mean":
                anchor = grouped.mean(dim=2, keepdim=True)  # expect: AMP004
            else:
                anchor = index_points(feats, fps_idx).unsqueeze(2)
            std = torch.std((grouped - anchor).reshape(b, -1), dim=-1, keepdim=True)  # expect: AMP004
            grouped = (grouped - anchor) / (std.view(b, 1, 1, 1) + 1e-8)  # expect: AMP011
            grouped = self.alpha * grouped + self.beta
        h = torch.cat([grouped_xyz, grouped], dim=-1).permute(0, 3, 2, 1)  # [B, C, K, S]
        h = F.relu(self.mlp(h))
        if self.pool == "max":
            h = torch.max(h, 2)[0]
        else:
            h = h.mean(2)  # expect: AMP004
        return new_xyz, h.transpose(1, 2)


class PointNet2Cls(nn.Module):
    def __init__(self, num_classes=40, use_normals=False, stages=None):
        super().__init__()
        stages = stages or [
            dict(npoint=512, radius=0.2, nsample=32, widths=[64, 64, 128]),
            dict(npoint=128, radius=0.4, nsample=64, widths=[128, 128, 256], center="mean"),
            dict(npoint=32, radius=0.8, nsample=64, widths=[256, 512, 1024], pool="avg"),
        ]
        c = 6 if use_normals else 3
        self.embedding = nn.Conv1d(c, 64, 1)
        self.sa_layers = nn.ModuleList()
        c = 64
        for st in stages:
            self.sa_layers.append(SetAbstraction(c_in=c, **st))
            c = st["widths"][-1]
        self.head = nn.Sequential(
            nn.Linear(c, 512), nn.LayerNorm(512), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(512, 256), nn.LayerNorm(256), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(256, num_classes),
        )

    def forward(self, pts):
        xyz = pts[:, :, :3].contiguous()
        feats = self.embedding(pts.transpose(1, 2)).transpose(1, 2)
        for sa in self.sa_layers:
            xyz, feats = sa(xyz, feats)
        global_feat = torch.max(feats, dim=1)[0]
        return self.head(global_feat)


def smooth_ce(pred, target, eps=0.2):
    n_class = pred.size(1)
    one_hot = torch.zeros_like(pred).scatter(1, target.view(-1, 1), 1)
    one_hot = one_hot * (1 - eps) + (1 - one_hot) * eps / (n_class - 1)
    log_prb = F.log_softmax(pred, dim=1)  # fp32 under CUDA autocast
    return -(one_hot * log_prb).sum(dim=1).mean()


def random_scale_shift(pts):
    scale = torch.empty(pts.size(0), 1, 3, device=pts.device).uniform_(2.0 / 3.0, 1.5)
    shift = torch.empty(pts.size(0), 1, 3, device=pts.device).uniform_(-0.2, 0.2)
    pts = pts.clone()
    pts[:, :, :3] = pts[:, :, :3] * scale + shift
    return pts


def train_epoch(model, loader, optimizer, device):
    model.train()
    correct, seen, total_loss = 0, 0, 0.0
    for pts, label in loader:
        pts, label = random_scale_shift(pts.to(device)), label.to(device).long()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            logits = model(pts)
            loss = smooth_ce(logits, label)
        loss.backward()
        optimizer.step()
        correct += (logits.argmax(-1) == label).sum().item()
        seen += label.numel()
        total_loss += loss.item() * label.numel()
    return total_loss / max(seen, 1), correct / max(seen, 1)


@torch.no_grad()
def test(model, loader, device, num_classes=40):
    model.eval()
    class_acc = np.zeros((num_classes, 2))
    for pts, label in loader:
        pts, label = pts.to(device), label.to(device).long()
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(pts).argmax(-1)
        for c in label.unique().tolist():
            m = label == c
            class_acc[c, 0] += (pred[m] == c).float().sum().item()
            class_acc[c, 1] += m.sum().item()
    per_class = class_acc[:, 0] / np.maximum(class_acc[:, 1], 1)
    return float(per_class.mean())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/modelnet40_normal_resampled")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=24)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model = PointNet2Cls(num_classes=40).to(device)
    model = DDP(model, device_ids=[rank])
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-5)
    train_set = torch.load(os.path.join(args.data, "train.pt"))
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8, drop_last=True)
    test_loader = DataLoader(torch.load(os.path.join(args.data, "test.pt")), batch_size=64)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss, acc = train_epoch(model, loader, optimizer, device)
        scheduler.step()
        if rank == 0:
            macc = test(model, test_loader, device)
            best = max(best, macc)
            print(f"epoch {epoch} loss {loss:.4f} train-acc {acc:.4f} test-mAcc {macc:.4f} best {best:.4f}")


if __name__ == "__main__":
    main()
