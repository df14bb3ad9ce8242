"""Point Transformer for part segmentation: kNN grouping, vector self-attention,
transition-down with local max pooling, and feature propagation.

Trained with CUDA fp16 autocast and a GradScaler.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def knn(pos, valid, k):
    """Indices of the k nearest valid neighbours of every point. pos: (B, N, 3)."""
    d = torch.cdist(pos.float(), pos.float())
    pair_ok = valid[:, :, None] & valid[:, None, :]
    d.masked_fill_(~pair_ok, 1e10)
    dist, idx = d.topk(k, dim=-1, largest=False)
    return idx, dist < 1e9


def gather(x, idx):
    """x: (B, N, C), idx: (B, M, K) -> (B, M, K, C)."""
    B, M, K = idx.shape
    flat = idx.reshape(B, M * K, 1).expand(-1, -1, x.size(-1))
    return torch.gather(x, 1, flat).reshape(B, M, K, x.size(-1))


def farthest_point_sample(pos, m):
    B, N, _ = pos.shape
    out = torch.zeros(B, m, dtype=torch.long, device=pos.device)
    dist = torch.full((B, N), 1e10, device=pos.device)
    far = torch.zeros(B, dtype=torch.long, device=pos.device)
    batch = torch.arange(B, device=pos.device)
    for i in range(m):
        out[:, i] = far
        c = pos[batch, far][:, None]
        dist = torch.minimum(dist, ((pos - c) ** 2).sum(-1))
        far = dist.argmax(-1)
    return out


class PointBatchNorm(nn.Module):
    """Batch norm over (batch, points) for channels-last point features."""

    def __init__(self, channels, momentum=0.1, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.momentum = momentum
        self.eps = eps

    def forward(self, x):
        if self.training:
            mean = x.mean(dim=(0, 1))  # expect: AMP004
            var = x.var(dim=(0, 1), unbiased=False)  # expect: AMP004
            with torch.no_grad():
                self.running_mean.lerp_(mean.float(), self.momentum)
                self.running_var.lerp_(var.float(), self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class VectorAttention(nn.Module):
    """Point Transformer layer: subtraction relation, position encoding MLP and
    channel-wise attention weights over the k neighbours."""

    def __init__(self, dim, k=16):
        super().__init__()
        self.k = k
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.pos_mlp = nn.Sequential(nn.Linear(3, dim), nn.ReLU(inplace=True), nn.Linear(dim, dim))
        self.attn_mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, dim))
        self.out_proj = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x, pos, idx, nbr_ok):
        q = self.to_q(x)
        k = gather(self.to_k(x), idx)
        v = gather(self.to_v(x), idx)
        rel = pos[:, :, None, :] - gather(pos, idx)
        pe = self.pos_mlp(rel)
        w = self.attn_mlp(q[:, :, None, :] - k + pe)
        w = w.masked_fill(~nbr_ok[..., None], -1e9)  # expect: AMP007
        w = F.softmax(w * self.scale, dim=2)
        out = ((v + pe) * w).sum(dim=2)
        return self.out_proj(out)


class PointTransformerBlock(nn.Module):
    def __init__(self, dim, k=16):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim, bias=False)
        self.bn1 = PointBatchNorm(dim)
        self.attn = VectorAttention(dim, k)
        self.bn2 = PointBatchNorm(dim)
        self.fc3 = nn.Linear(dim, dim, bias=False)
        self.bn3 = PointBatchNorm(dim)

    def forward(self, x, pos, idx, nbr_ok):
        h = F.relu(self.bn1(self.fc1(x)))
        h = F.relu(self.bn2(self.attn(h, pos, idx, nbr_ok)))
        h = self.bn3(self.fc3(h))
        return F.relu(x + h)


class GeometricAffine(nn.Module):
    """Normalise grouped neighbour features relative to their anchor (PointMLP)."""

    def __init__(self, dim):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, grouped):
        B = grouped.size(0)
        diff = grouped - grouped[:, :, :1]
        std = diff.reshape(B, -1).std(dim=-1)  # expect: AMP004
        diff = diff / (std[:, None, None, None] + 1e-8)  # expect: AMP011
        return self.alpha * diff + self.beta


class TransitionDown(nn.Module):
    def __init__(self, in_dim, out_dim, stride=4, k=16):
        super().__init__()
        self.stride, self.k = stride, k
        self.lin = nn.Linear(in_dim + 3, out_dim, bias=False)
        self.affine = GeometricAffine(out_dim)
        self.mlp = nn.Sequential(nn.Linear(out_dim, out_dim), nn.ReLU(inplace=True))

    def forward(self, x, pos, valid):
        m = max(pos.size(1) // self.stride, 1)
        centers = farthest_point_sample(pos, m)
        batch = torch.arange(pos.size(0), device=pos.device)[:, None]
        new_pos = pos[batch, centers]
        new_valid = valid[batch, centers]
        d = torch.cdist(new_pos.float(), pos.float())
        d = d.masked_fill(~valid[:, None, :], float("inf"))
        idx = d.topk(self.k, dim=-1, largest=False).indices
        nbr_ok = torch.isfinite(d.gather(-1, idx))
        rel = gather(pos, idx) - new_pos[:, :, None]
        grouped = self.lin(torch.cat([gather(x, idx), rel], dim=-1))
        grouped = self.mlp(self.affine(grouped))
        grouped = torch.where(nbr_ok[..., None], grouped, torch.full_like(grouped, -1e9))  # expect: AMP007
        return grouped.max(dim=2).values, new_pos, new_valid


class TransitionUp(nn.Module):
    """Inverse-distance interpolation from the coarse to the fine level."""

    def __init__(self, coarse_dim, fine_dim):
        super().__init__()
        self.up = nn.Linear(coarse_dim, fine_dim)
        self.skip = nn.Linear(fine_dim, fine_dim)

    def forward(self, x_coarse, pos_coarse, x_fine, pos_fine):
        d = torch.cdist(pos_fine, pos_coarse)
        dist, idx = d.topk(3, dim=-1, largest=False)
        recip = 1.0 / (dist + 1e-8)
        weight = recip / recip.sum(dim=-1, keepdim=True)
        up = (gather(self.up(x_coarse), idx) * weight[..., None]).sum(dim=2)
        return up + self.skip(x_fine)


class PointTransformerSeg(nn.Module):
    def __init__(self, in_dim=6, dims=(32, 64, 128), n_classes=50, k=16):
        super().__init__()
        self.k = k
        self.stem = nn.Linear(in_dim, dims[0])
        self.enc0 = PointTransformerBlock(dims[0], k)
        self.down1 = TransitionDown(dims[0], dims[1], k=k)
        self.enc1 = PointTransformerBlock(dims[1], k)
        self.down2 = TransitionDown(dims[1], dims[2], k=k)
        self.enc2 = PointTransformerBlock(dims[2], k)
        self.up2 = TransitionUp(dims[2], dims[1])
        self.up1 = TransitionUp(dims[1], dims[0])
        self.head = nn.Sequential(nn.Linear(dims[0], dims[0]), nn.ReLU(inplace=True), nn.Linear(dims[0], n_classes))

    def forward(self, pos, feats, valid):
        x0 = self.stem(feats)
        idx0, ok0 = knn(pos, valid, self.k)
        x0 = self.enc0(x0, pos, idx0, ok0)
        x1, pos1, valid1 = self.down1(x0, pos, valid)
        idx1, ok1 = knn(pos1, valid1, self.k)
        x1 = self.enc1(x1, pos1, idx1, ok1)
        x2, pos2, valid2 = self.down2(x1, pos1, valid1)
        idx2, ok2 = knn(pos2, valid2, self.k)
        x2 = self.enc2(x2, pos2, idx2, ok2)
        y1 = self.up2(x2, pos2, x1, pos1)
        y0 = self.up1(y1, pos1, x0, pos)
        return self.head(y0)


def seg_loss(logits, labels, valid, n_classes, dice_weight=0.5):
    ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    ce = (ce * valid).sum() / valid.sum().clamp(min=1)
    probs = logits.softmax(dim=-1) * valid[..., None]
    onehot = F.one_hot(labels, n_classes) * valid[..., None]
    inter = (probs * onehot).sum(dim=(0, 1))
    union = probs.sum(dim=(0, 1)) + onehot.sum(dim=(0, 1))
    dice = 1.0 - ((2 * inter + 1e-8) / (union + 1e-8)).mean()
    return ce + dice_weight * dice


def train(loader, val_loader, epochs=100, lr=0.05, n_classes=50, accum=2, device="cuda"):
    model = PointTransformerSeg(in_dim=6, n_classes=n_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    for epoch in range(epochs):
        model.train()
        running = 0.0
        for it, (pos, feats, labels, valid) in enumerate(loader):
            pos, feats = pos.to(device), feats.to(device)
            labels, valid = labels.to(device), valid.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(pos, feats, valid)
                loss = seg_loss(logits, labels, valid.float(), n_classes) / accum
            loss = scaler.scale(loss)
            loss.backward()
            if (it + 1) % accum == 0:
                optimizer.step()  # expect: AMP006
                optimizer.zero_grad(set_to_none=True)
            running += loss.item() / scaler.get_scale()
        sched.step()
        miou = evaluate_miou(model, val_loader, n_classes, device)
        print(f"epoch {epoch}: loss {running / max(len(loader), 1):.4f} mIoU {miou:.3f}")
    return model


@torch.no_grad()
def evaluate_miou(model, loader, n_classes, device="cuda"):
    model.eval()
    inter = torch.zeros(n_classes, device=device)
    union = torch.zeros(n_classes, device=device)
    for pos, feats, labels, valid in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(pos.to(device), feats.to(device), valid.to(device)).argmax(-1)
        labels, valid = labels.to(device), valid.to(device)
        for c in range(n_classes):
            p, t = (pred == c) & valid, (labels == c) & valid
            inter[c] += (p & t).sum()
            union[c] += (p | t).sum()
    return (inter / union.clamp(min=1)).mean().item()
