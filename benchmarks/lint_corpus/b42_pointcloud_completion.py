"""PCN-style point-cloud completion (PointNet encoder, coarse MLP decoder, folding
refinement) trained with a Chamfer distance.

Runs on CPU workstations: bf16 CPU autocast through a functools.partial alias, no
GradScaler (bf16 needs none).
"""
import argparse
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

amp_ctx = functools.partial(torch.autocast, device_type="cpu", dtype=torch.bfloat16)


@dataclass
class PCNOutput:
    coarse: torch.Tensor       # (B, M, 3)
    fine: torch.Tensor         # (B, M * g * g, 3)
    valid_logit: torch.Tensor  # (B, M): is the coarse point on the true surface
    code: torch.Tensor         # (B, latent)


def make_fold_grid(g, scale=0.05):
    lin = torch.linspace(-scale, scale, g)
    gx, gy = torch.meshgrid(lin, lin, indexing="ij")
    return torch.stack([gx.reshape(-1), gy.reshape(-1)], dim=0)  # (2, g*g)


class PointNetEncoder(nn.Module):
    def __init__(self, latent=1024):
        super().__init__()
        self.mlp1 = nn.Sequential(nn.Conv1d(3, 128, 1), nn.ReLU(), nn.Conv1d(128, 256, 1))
        self.mlp2 = nn.Sequential(nn.Conv1d(512, 512, 1), nn.ReLU(), nn.Conv1d(512, latent, 1))
        self.norm = nn.LayerNorm(latent)

    def forward(self, pts):
        f = self.mlp1(pts.transpose(1, 2))
        g = f.max(dim=2, keepdim=True).values
        f = self.mlp2(torch.cat([f, g.expand_as(f)], dim=1))
        return self.norm(f.max(dim=2).values)


class PCN(nn.Module):
    def __init__(self, latent=1024, num_coarse=1024, grid_size=4):
        super().__init__()
        self.num_coarse = num_coarse
        self.grid_size = grid_size
        self.encoder = PointNetEncoder(latent)
        self.coarse_fc = nn.Sequential(
            nn.Linear(latent, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 3 * num_coarse))
        self.valid_head = nn.Linear(latent, num_coarse)
        self.folding = nn.Sequential(
            nn.Conv1d(latent + 2 + 3, 512, 1), nn.ReLU(), nn.Conv1d(512, 512, 1), nn.ReLU(), nn.Conv1d(512, 3, 1))
        self.register_buffer("grid", make_fold_grid(grid_size))

    def forward(self, partial):
        B = partial.size(0)
        code = self.encoder(partial)
        coarse = self.coarse_fc(code).view(B, self.num_coarse, 3)
        g2 = self.grid_size ** 2
        centers = coarse.repeat_interleave(g2, dim=1)                       # (B, M*g2, 3)
        seeds = self.grid.repeat(1, self.num_coarse).unsqueeze(0).expand(B, -1, -1)
        feat = torch.cat([code[:, :, None].expand(-1, -1, centers.size(1)), seeds, centers.transpose(1, 2)], dim=1)
        fine = self.folding(feat).transpose(1, 2) + centers
        return PCNOutput(coarse, fine, self.valid_head(code), code)


def build_model(cfg):
    return PCN(cfg.latent, cfg.num_coarse, cfg.grid_size)


def chamfer_distance(x, y):
    """Symmetric squared-L2 Chamfer distance per sample, x (B, N, 3), y (B, M, 3)."""
    xx = (x * x).sum(-1)  # expect: AMP004
    yy = (y * y).sum(-1)
    xy = torch.bmm(x, y.transpose(1, 2))
    d = (xx[:, :, None] + yy[:, None, :] - 2.0 * xy).clamp_min(0.0)
    return d.min(dim=2).values.mean(dim=1) + d.min(dim=1).values.mean(dim=1)


def farthest_point_subsample(pts, k):
    B, N, _ = pts.shape
    idx = torch.zeros(B, k, dtype=torch.long, device=pts.device)
    dist = torch.full((B, N), float("inf"), device=pts.device)
    far = torch.randint(0, N, (B,), device=pts.device)
    for i in range(k):
        idx[:, i] = far
        c = pts[torch.arange(B), far][:, None]
        dist = torch.minimum(dist, ((pts - c) ** 2).sum(-1))
        far = dist.argmax(-1)
    return torch.gather(pts, 1, idx[..., None].expand(-1, -1, 3))


def fine_weight(step, warmup=10_000):
    return min(1.0, step / warmup)


def train_epoch(model, loader, optimizer, cfg, epoch, global_step):
    model.train()
    for partial, gt, valid in loader:
        gt_coarse = farthest_point_subsample(gt, cfg.num_coarse)
        with amp_ctx():
            out = model(partial)
            cd_coarse = chamfer_distance(out.coarse, gt_coarse).mean()
            cd_fine = chamfer_distance(out.fine, gt).mean()
            valid_prob = torch.sigmoid(out.valid_logit)
            valid_loss = F.binary_cross_entropy(valid_prob, valid)  # expect: AMP003
            pred_count = valid_prob.sum(dim=-1)  # expect: AMP004
            count_loss = F.l1_loss(pred_count, valid.sum(dim=-1)) / cfg.num_coarse
            # centroid in fp32 (dtype=) and compared with the fp32 target centroid
            centroid = out.fine.mean(dim=1, dtype=torch.float32)
            center_loss = (centroid - gt.mean(dim=1)).norm(dim=-1).mean()
            with torch.no_grad():
                code_full = model.encoder(gt)
            consistency = (out.code - code_full).abs().mean()  # expect: AMP004
            loss = (cd_coarse + fine_weight(global_step) * cd_fine + 0.1 * valid_loss
                    + 0.01 * count_loss + 0.1 * center_loss + cfg.cons_weight * consistency)
            loss.backward()  # expect: AMP008
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_step += 1
        if global_step % 200 == 0:
            print(f"epoch {epoch} step {global_step} cd_f {cd_fine.item() * 1e4:.3f} loss {loss.item():.4f}")
    return global_step


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, n = 0.0, 0
    for partial, gt, _ in loader:
        with amp_ctx():
            out = model(partial)
            cd = chamfer_distance(out.fine, gt)
        total += cd.float().sum().item()
        n += cd.numel()
    model.train()
    return total / max(n, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--latent", type=int, default=1024)
    p.add_argument("--num-coarse", type=int, default=1024)
    p.add_argument("--grid-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--cons-weight", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=32)
    cfg = p.parse_args()
    torch.set_num_threads(cfg.threads)

    data = torch.load(cfg.data)
    train_loader = DataLoader(data["train"], batch_size=32, shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(data["val"], batch_size=64)

    model = build_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.7)
    best, step = math.inf, 0
    for epoch in range(cfg.epochs):
        step = train_epoch(model, train_loader, optimizer, cfg, epoch, step)
        sched.step()
        cd = evaluate(model, val_loader)
        print(f"epoch {epoch}: val CD {cd * 1e4:.3f}e-4")
        if cd < best:
            best = cd
            torch.save(model.state_dict(), "pcn_best.pt")


if __name__ == "__main__":
    main()
