"""2D-to-3D human pose lifting with a spatial-temporal transformer.

Inputs are sequences of detected 2D keypoints (B, T, J, 2) with per-joint
confidences; outputs are root-relative 3D joints for the centre frame.
"""
import functools
import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

H36M_PARENTS = [-1, 0, 1, 2, 0, 4, 5, 0, 7, 8, 9, 8, 11, 12, 8, 14, 15]


class JointNorm(nn.Module):
    """LayerNorm over the channel dim written out by hand (kept for checkpoint compat)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mu = x.float().mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)  # expect: AMP004
        y = (x - mu) * torch.rsqrt(var.float() + self.eps)
        return (y * self.gamma + self.beta).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: float = 2.0, drop: float = 0.1):
        super().__init__()
        hidden = int(dim * ratio)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(drop), nn.Linear(hidden, dim))

    def forward(self, x):
        return self.net(x)


class FrameAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 8, drop: float = 0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x, valid: Optional[torch.Tensor] = None):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        if valid is not None:
            scores[~valid[:, None, None, :].expand_as(scores)] = -1e9  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class JointAttention(nn.Module):
    """Attention across joints with a skeleton-distance bias."""

    def __init__(self, dim: int, heads: int = 4, num_joints: int = 17):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("hop", torch.from_numpy(_hop_distance(num_joints)).float())

    def forward(self, x):
        b, j, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(b, j, self.heads, -1).transpose(1, 2)
        k = k.view(b, j, self.heads, -1).transpose(1, 2)
        v = v.view(b, j, self.heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
        far = self.hop > 4
        scores = scores.masked_fill(far, -1e4)
        attn = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, j, c))


def _hop_distance(num_joints: int) -> np.ndarray:
    adj = np.full((num_joints, num_joints), 1e9)
    for i, p in enumerate(H36M_PARENTS[:num_joints]):
        adj[i, i] = 0
        if p >= 0:
            adj[i, p] = adj[p, i] = 1
    for k in range(num_joints):
        adj = np.minimum(adj, adj[:, k : k + 1] + adj[k : k + 1, :])
    return adj


class STBlock(nn.Module):
    def __init__(self, dim: int, heads: int, num_joints: int):
        super().__init__()
        self.norm_s = JointNorm(dim)
        self.spatial = JointAttention(dim, heads // 2, num_joints)
        self.norm_t = nn.LayerNorm(dim)
        self.temporal = FrameAttention(dim, heads)
        self.norm_m = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x, valid=None):
        b, t, j, c = x.shape
        xs = x.reshape(b * t, j, c)
        xs = xs + self.spatial(self.norm_s(xs))
        xt = xs.reshape(b, t, j, c).permute(0, 2, 1, 3).reshape(b * j, t, c)
        v = valid.repeat_interleave(j, dim=0) if valid is not None else None
        xt = xt + self.temporal(self.norm_t(xt), v)
        xt = xt + self.mlp(self.norm_m(xt))
        return xt.reshape(b, j, t, c).permute(0, 2, 1, 3)


def temporal_spread(h: torch.Tensor) -> torch.Tensor:
    return h.std(dim=1, keepdim=True)  # expect: AMP004


class PoseLifter(nn.Module):
    def __init__(self, num_joints: int = 17, dim: int = 128, depth: int = 4, heads: int = 8, frames: int = 81):
        super().__init__()
        self.frames = frames
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([STBlock(dim, heads, num_joints) for _ in range(depth)])
        self.spread_proj = nn.Linear(dim, dim)

    def forward(self, kp2d, conf, valid=None):
        t = torch.linspace(-1.0, 1.0, kp2d.size(1), device=kp2d.device)
        t = t.view(1, -1, 1, 1).expand(kp2d.size(0), -1, kp2d.size(2), 1)
        x = self.embed(torch.cat([kp2d, conf.unsqueeze(-1), t], dim=-1))
        for blk in self.blocks:
            x = blk(x, valid)
        pooled = x.mean(dim=1)  # expect: AMP004
        spread = temporal_spread(x).squeeze(1)
        centre = x[:, x.size(1) // 2]
        return centre + pooled + self.spread_proj(spread)


def build_model(cfg: Dict) -> Tuple[nn.Module, nn.Module]:
    body = PoseLifter(cfg["joints"], cfg["dim"], cfg["depth"], cfg["heads"], cfg["frames"])
    head = nn.Sequential(nn.LayerNorm(cfg["dim"]), nn.Linear(cfg["dim"], 3))
    return body, head


def mpjpe(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.norm(pred - target, dim=-1).mean()


class BoneLengthLoss(nn.Module):
    def __init__(self, parents=H36M_PARENTS):
        super().__init__()
        self.child = [i for i, p in enumerate(parents) if p >= 0]
        self.parent = [p for p in parents if p >= 0]

    def forward(self, pred, target):
        pb = (pred[:, self.child] - pred[:, self.parent]).norm(dim=-1)
        tb = (target[:, self.child] - target[:, self.parent]).norm(dim=-1)
        return F.smooth_l1_loss(pb, tb)


amp_ctx = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16)


def fit(cfg: Dict, train_loader, val_loader=None):
    body, head = build_model(cfg)
    body, head = body.cuda(), head.cuda()
    params = list(body.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg.get("wd", 0.05))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["epochs"])
    scaler = torch.amp.GradScaler("cuda")
    bone_loss = BoneLengthLoss()
    best = float("inf")
    for epoch in range(cfg["epochs"]):
        body.train()
        head.train()
        for kp2d, conf, valid, gt3d in train_loader:
            kp2d, conf, valid, gt3d = kp2d.cuda(), conf.cuda(), valid.cuda(), gt3d.cuda()
            optimizer.zero_grad(set_to_none=True)
            with amp_ctx():
                feats = body(kp2d, conf, valid)
                pred = head(feats)
                loss = mpjpe(pred, gt3d) + cfg["bone_w"] * bone_loss(pred, gt3d)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, cfg.get("clip", 1.0))
            scaler.step(optimizer)
            scaler.update()
        sched.step()
        if val_loader is not None:
            err = evaluate(body, head, val_loader)
            if err < best:
                best = err
                torch.save({"body": body.state_dict(), "head": head.state_dict()}, "lifter_best.pt")
    return best


@torch.no_grad()
def evaluate(body, head, loader) -> float:
    body.eval()
    head.eval()
    errs = []
    for kp2d, conf, valid, gt3d in loader:
        with amp_ctx():
            pred = head(body(kp2d.cuda(), conf.cuda(), valid.cuda()))
        errs.append(torch.norm(pred.float() - gt3d.cuda(), dim=-1).mean(dim=-1).cpu())
    return torch.cat(errs).mean().item() * 1000.0
