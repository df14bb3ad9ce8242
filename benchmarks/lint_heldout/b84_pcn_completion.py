"""Point cloud completion: PointNet++ set-abstraction encoder + style-modulated folding decoder."""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from datasets.shapenet_pcn import ShapeNetPCN


def square_distance(src, dst):
    # Geometry is done in fp32 regardless of the surrounding precision.
    with torch.autocast("cuda", enabled=False):
        src, dst = src.float(), dst.float()
        d = -2 * torch.matmul(src, dst.transpose(1, 2))
        d += torch.sum(src ** 2, -1)[:, :, None]
        d += torch.sum(dst ** 2, -1)[:, None, :]
    return d


def farthest_point_sample(xyz, npoint):
    with torch.autocast("cuda", enabled=False):
        xyz = xyz.float()
        B, N, _ = xyz.shape
        centroids = torch.zeros(B, npoint, dtype=torch.long, device=xyz.device)
        distance = torch.full((B, N), 1e10, dtype=torch.float32, device=xyz.device)
        farthest = torch.randint(0, N, (B,), device=xyz.device)
        batch = torch.arange(B, device=xyz.device)
        for i in range(npoint):
            centroids[:, i] = farthest
            centroid = xyz[batch, farthest].unsqueeze(1)
            distance = torch.minimum(distance, torch.sum((xyz - centroid) ** 2, -1))
            farthest = distance.argmax(-1)
    return centroids


def index_points(points, idx):
    batch = torch.arange(points.shape[0], device=points.device).view(-1, *([1] * (idx.dim() - 1)))
    return points[batch, idx]


class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, nsample, c_in, widths):
        super().__init__()
        self.npoint, self.radius, self.nsample = npoint, radius, nsample
        layers, c = [], c_in + 3
        for w in widths:
            layers += [nn.Conv2d(c, w, 1), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
            c = w
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, feats):
        new_xyz = index_points(xyz, farthest_point_sample(xyz, self.npoint))
        sqrdists = square_distance(new_xyz, xyz)
        dist_k, idx = sqrdists.topk(self.nsample, dim=-1, largest=False)
        valid = dist_k <= self.radius ** 2
        grouped = index_points(xyz, idx) - new_xyz.unsqueeze(2)
        if feats is not None:
            grouped = torch.cat([grouped, index_points(feats, idx)], dim=-1)
        h = self.mlp(grouped.permute(0, 3, 2, 1))
        h = h.masked_fill(~valid.permute(0, 2, 1).unsqueeze(1), -1e9)  # expect: AMP007
        return new_xyz, h.max(dim=2)[0].transpose(1, 2)


class AdaptivePointNorm(nn.Module):
    def __init__(self, channels, code_dim):
        super().__init__()
        self.affine = nn.Linear(code_dim, 2 * channels)

    def forward(self, x, code):
        mu = x.mean(dim=2, keepdim=True)  # expect: AMP004
        sigma = x.std(dim=2, keepdim=True) + 1e-5  # expect: AMP004
        gamma, beta = self.affine(code).unsqueeze(-1).chunk(2, dim=1)
        return (1 + gamma) * (x - mu) / sigma + beta


class FoldingDecoder(nn.Module):
    def __init__(self, code_dim=1024, grid=4, n_coarse=1024, hidden=512):
        super().__init__()
        self.grid, self.n_coarse = grid, n_coarse
        self.coarse = nn.Sequential(nn.Linear(code_dim, 1024), nn.ReLU(), nn.Linear(1024, 3 * n_coarse))
        self.conv1 = nn.Conv1d(3 + 2, hidden, 1)
        self.norm1 = AdaptivePointNorm(hidden, code_dim)
        self.conv2 = nn.Conv1d(hidden, hidden, 1)
        self.norm2 = AdaptivePointNorm(hidden, code_dim)
        self.out = nn.Conv1d(hidden, 3, 1)
        self.normal_head = nn.Conv1d(hidden, 3, 1)
        lin = torch.linspace(-0.05, 0.05, grid)
        self.register_buffer("seed", torch.stack(torch.meshgrid(lin, lin, indexing="ij"), 0).view(2, -1))

    def forward(self, code):
        B = code.shape[0]
        coarse = self.coarse(code).view(B, self.n_coarse, 3)
        centers = coarse.repeat_interleave(self.grid ** 2, dim=1).transpose(1, 2)
        seed = self.seed.repeat(1, self.n_coarse).unsqueeze(0).expand(B, -1, -1)
        h = F.relu(self.norm1(self.conv1(torch.cat([centers, seed], 1)), code))
        h = F.relu(self.norm2(self.conv2(h), code))
        fine = (self.out(h) + centers).transpose(1, 2)
        normals = F.normalize(self.normal_head(h), dim=1).transpose(1, 2)
        return coarse, fine, normals


class PCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa1 = SetAbstraction(512, 0.1, 32, 0, [64, 64, 128])
        self.sa2 = SetAbstraction(128, 0.2, 32, 128, [128, 128, 256])
        self.global_mlp = nn.Sequential(nn.Linear(256 + 3, 512), nn.ReLU(), nn.Linear(512, 1024))
        self.decoder = FoldingDecoder()

    def forward(self, partial):
        xyz, f = self.sa1(partial, None)
        xyz, f = self.sa2(xyz, f)
        code = self.global_mlp(torch.cat([xyz, f], -1)).max(dim=1)[0]
        return self.decoder(code)


def chamfer_distance(p, q):
    d = torch.cdist(p.float(), q.float()) ** 2
    return d.min(dim=2)[0].mean() + d.min(dim=1)[0].mean()


def train_one_epoch(model, loader, optimizer, scaler, epoch, args):
    model.train()
    for step, batch in enumerate(loader):
        partial, gt = batch["partial"].cuda(non_blocking=True), batch["gt"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            coarse, fine, _ = model(partial)
            loss = chamfer_distance(coarse, gt) + args.alpha * chamfer_distance(fine, gt)
        scaler.scale(loss / args.accum_steps).backward()
        if (step + 1) % args.accum_steps == 0:
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"[{epoch}:{step}] cd {loss.item() * 1e3:.3f}e-3")


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, n = 0.0, 0
    for batch in loader:
        _, fine, _ = model(batch["partial"].cuda())
        total += chamfer_distance(fine, batch["gt"].cuda()).item() * len(fine)
        n += len(fine)
    return total / max(n, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/PCN")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--accum-steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--ckpt-dir", default="checkpoints/pcn")
    args = ap.parse_args()

    train_loader = DataLoader(ShapeNetPCN(args.root, "train"), args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(ShapeNetPCN(args.root, "val"), args.batch_size, num_workers=4)
    model = PCN().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cuda")
    best = float("inf")
    os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, args)
        cd = evaluate(model, val_loader)
        if cd < best:
            best = cd
            torch.save(model.state_dict(), os.path.join(args.ckpt_dir, "best.pth"))
        print(f"epoch {epoch}: val cd {cd * 1e3:.3f}e-3 (best {best * 1e3:.3f}e-3)")


if __name__ == "__main__":
    main()
