"""Point-cloud segmentation (PointNet++-like) training with AMP and class-balanced loss."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def square_distance(src, dst):
    return torch.sum((src[:, :, None] - dst[:, None]) ** 2, dim=-1)


def farthest_point_sample(xyz, npoint):
    B, N, _ = xyz.shape
    centroids = torch.zeros(B, npoint, dtype=torch.long, device=xyz.device)
    distance = torch.ones(B, N, device=xyz.device) * 1e10
    farthest = torch.randint(0, N, (B,), dtype=torch.long, device=xyz.device)
    batch_indices = torch.arange(B, dtype=torch.long, device=xyz.device)
    for i in range(npoint):
        centroids[:, i] = farthest
        centroid = xyz[batch_indices, farthest, :].view(B, 1, 3)
        dist = torch.sum((xyz - centroid) ** 2, -1)
        distance = torch.min(distance, dist)
        farthest = torch.max(distance, -1)[1]
    return centroids


def query_ball_point(radius, nsample, xyz, new_xyz):
    B, N, _ = xyz.shape
    S = new_xyz.shape[1]
    group_idx = torch.arange(N, dtype=torch.long, device=xyz.device).view(1, 1, N).repeat([B, S, 1])
    sqrdists = square_distance(new_xyz, xyz)
    group_idx[sqrdists > radius ** 2] = N
    return group_idx.sort(dim=-1)[0][:, :, :nsample]


class ClassBalancedFocal(nn.Module):
    def __init__(self, counts, beta=0.999, gamma=2.0):
        super().__init__()
        effective = 1.0 - np.power(beta, counts)
        weights = (1.0 - beta) / np.array(effective)
        self.register_buffer("weights", torch.tensor(weights / weights.sum() * len(counts), dtype=torch.float32))
        self.gamma = gamma

    def forward(self, logits, target):
        logp = F.log_softmax(logits, dim=1)
        p = logp.exp()
        focal = (1 - p) ** self.gamma * logp
        return F.nll_loss(focal, target, weight=self.weights)


def train_epoch(model, loader, optimizer, criterion, scaler, device):
    model.train()
    for points, labels in loader:
        points, labels = points.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(points)
        loss = criterion(logits.transpose(1, 2), labels)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def train_epoch_correct(model, loader, optimizer, criterion, scaler, device):
    model.train()
    for points, labels in loader:
        points, labels = points.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(points)
            loss = criterion(logits.transpose(1, 2), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    conf = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for points, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(points.to(device)).argmax(-1)
        idx = labels.to(device).flatten() * num_classes + pred.flatten()
        conf += torch.bincount(idx, minlength=num_classes ** 2).view(num_classes, num_classes)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    return iou.mean().item()
