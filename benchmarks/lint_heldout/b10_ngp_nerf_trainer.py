"""Instant-NGP style NeRF in pure PyTorch: multiresolution hash encoding, tiny MLPs,
an occupancy grid for empty-space skipping, and a proposal network distilled afterwards.

    python main_nerf.py data/fox --workspace trial_fox --fp16 --iters 30000
"""
import argparse
import math
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function
from torch.cuda.amp import custom_bwd, custom_fwd


class _TruncExp(Function):
    @staticmethod
    @custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    @custom_bwd  # expect: AMP009
    def backward(ctx, g):
        x = ctx.saved_tensors[0]
        return g * torch.exp(x.clamp(-15, 15))


trunc_exp = _TruncExp.apply


class HashGridEncoder(nn.Module):
    PRIMES = (1, 2654435761, 805459861)

    def __init__(self, n_levels=16, n_features=2, log2_hashmap_size=19, base_res=16, max_res=2048, bound=1.0):
        super().__init__()
        self.n_levels, self.n_features, self.bound = n_levels, n_features, bound
        self.hashmap_size = 2 ** log2_hashmap_size
        growth = math.exp((math.log(max_res) - math.log(base_res)) / (n_levels - 1))
        self.resolutions = [int(base_res * growth ** i) for i in range(n_levels)]
        self.embeddings = nn.Parameter(torch.empty(n_levels, self.hashmap_size, n_features).uniform_(-1e-4, 1e-4))
        self.output_dim = n_levels * n_features

    def _hash(self, coords):
        h = torch.zeros_like(coords[..., 0])
        for i, p in enumerate(self.PRIMES):
            h ^= coords[..., i] * p
        return h % self.hashmap_size

    def forward(self, x):
        x = (x + self.bound) / (2 * self.bound)
        feats = []
        for lvl, res in enumerate(self.resolutions):
            pos = x * res
            p0 = pos.floor().long()
            w = pos - p0
            out = 0
            for corner in range(8):
                offset = torch.tensor([(corner >> d) & 1 for d in range(3)], device=x.device)
                idx = self._hash(p0 + offset)
                cw = torch.prod(torch.where(offset.bool(), w, 1 - w), dim=-1, keepdim=True)
                out = out + cw * self.embeddings[lvl][idx]
            feats.append(out)
        return torch.cat(feats, dim=-1)


class NeRFNetwork(nn.Module):
    def __init__(self, bound=1.0, hidden=64, geo_feat_dim=15):
        super().__init__()
        self.bound = bound
        self.encoder = HashGridEncoder(bound=bound)
        self.sigma_net = nn.Sequential(nn.Linear(self.encoder.output_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 1 + geo_feat_dim))
        self.color_net = nn.Sequential(nn.Linear(3 + geo_feat_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, hidden),
                                       nn.ReLU(inplace=True), nn.Linear(hidden, 3))

    def density(self, x):
        inside = (x.abs() <= self.bound).all(dim=-1)
        h = self.sigma_net(self.encoder(x))
        raw_sigma = h[..., 0].masked_fill(~inside, -1e10)  # expect: AMP007
        return trunc_exp(raw_sigma), h[..., 1:]

    def forward(self, x, d):
        sigma, geo_feat = self.density(x)
        color = torch.sigmoid(self.color_net(torch.cat([d, geo_feat], dim=-1)))
        return sigma, color


class ProposalNet(nn.Module):
    def __init__(self, bound=1.0):
        super().__init__()
        self.encoder = HashGridEncoder(n_levels=5, log2_hashmap_size=17, max_res=128, bound=bound)
        self.mlp = nn.Sequential(nn.Linear(self.encoder.output_dim, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))

    def forward(self, x):
        return trunc_exp(self.mlp(self.encoder(x)).squeeze(-1))


def render_rays(model, rays_o, rays_d, near, far, num_steps=128, bg_color=1.0, perturb=True):
    t_vals = torch.linspace(0.0, 1.0, steps=num_steps, device=rays_o.device)
    z_vals = near * (1.0 - t_vals) + far * t_vals
    z_vals = z_vals.expand(rays_o.shape[0], num_steps).contiguous()
    if perturb:
        z_vals = z_vals + (torch.rand_like(z_vals) - 0.5) * (far - near) / num_steps
    xyzs = rays_o[:, None, :] + rays_d[:, None, :] * z_vals[..., None]
    dirs = rays_d[:, None, :].expand_as(xyzs)
    sigmas, rgbs = model(xyzs.reshape(-1, 3), dirs.reshape(-1, 3))
    sigmas, rgbs = sigmas.view(-1, num_steps), rgbs.view(-1, num_steps, 3)
    deltas = torch.cat([z_vals[..., 1:] - z_vals[..., :-1], torch.full_like(z_vals[..., :1], 1e10)], dim=-1)
    alphas = 1.0 - torch.exp(-deltas * sigmas)
    trans = torch.cumprod(torch.cat([torch.ones_like(alphas[..., :1]), 1.0 - alphas + 1e-10], dim=-1), dim=-1)[..., :-1]
    weights = alphas * trans
    weights_sum = weights.sum(dim=-1)
    depth = (weights * z_vals).sum(dim=-1)
    image = (weights[..., None] * rgbs).sum(dim=-2) + (1 - weights_sum[..., None]) * bg_color
    return {"image": image, "depth": depth, "weights_sum": weights_sum, "weights": weights, "xyzs": xyzs}


class OccupancyGrid:
    """Cascaded density grid (fp16 to keep 128^3 x cascades in memory) used to skip empty space."""

    def __init__(self, resolution=128, cascades=2, bound=1.0, device="cuda"):
        self.resolution, self.cascades, self.bound = resolution, cascades, bound
        self.grid = torch.zeros(cascades, resolution ** 3, dtype=torch.float16, device=device)
        self.mean_density = 0.0

    @torch.no_grad()
    def update(self, model, decay=0.95, samples=2 ** 18):
        coords = torch.rand(self.cascades, samples, 3, device=self.grid.device) * 2 - 1
        idx = ((coords + 1) / 2 * (self.resolution - 1)).long()
        flat = (idx[..., 0] * self.resolution + idx[..., 1]) * self.resolution + idx[..., 2]
        for c in range(self.cascades):
            scale = min(2 ** c, self.bound)
            sigma, _ = model.density(coords[c] * scale)
            cur = self.grid[c].clone()
            cur[flat[c]] = sigma.half()
            self.grid[c] = torch.maximum(self.grid[c] * decay, cur)
        self.mean_density = self.grid.clamp(min=0).mean().item()  # expect: AMP004

    def threshold(self, density_thresh=0.01):
        return min(self.mean_density, density_thresh)


class NeRFTrainer:
    def __init__(self, opt, model, device="cuda"):
        self.opt = opt
        self.device = device
        self.model = model.to(device)
        self.occ = OccupancyGrid(bound=opt.bound, device=device)
        self.optimizer = torch.optim.Adam(
            [{"params": self.model.encoder.parameters(), "lr": opt.lr},
             {"params": list(self.model.sigma_net.parameters()) + list(self.model.color_net.parameters()), "lr": opt.lr,
              "weight_decay": 1e-6}],
            betas=(0.9, 0.99), eps=1e-15)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda it: 0.1 ** min(it / opt.iters, 1))
        self.scaler = torch.amp.GradScaler("cuda", enabled=opt.fp16)
        self.criterion = nn.MSELoss(reduction="none")
        self.global_step = 0

    def train_step(self, data):
        rays_o, rays_d = data["rays_o"].to(self.device), data["rays_d"].to(self.device)
        images = data["images"].to(self.device)
        gt_rgb, gt_mask = images[..., :3], images[..., 3]
        bg_color = torch.rand_like(gt_rgb)
        gt_rgb = gt_rgb * gt_mask[..., None] + bg_color * (1 - gt_mask[..., None])
        outputs = render_rays(self.model, rays_o, rays_d, self.opt.near, self.opt.far, bg_color=bg_color)
        loss = self.criterion(outputs["image"], gt_rgb).mean()
        if self.opt.lambda_mask > 0:
            opacity = outputs["weights_sum"].clamp(1e-3, 1 - 1e-3)
            loss = loss + self.opt.lambda_mask * F.binary_cross_entropy(opacity, gt_mask)  # expect: AMP003
        return outputs["image"], gt_rgb, loss

    def backward(self, loss):
        self.scaler.scale(loss).backward()  # expect: AMP008
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opt.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_one_epoch(self, loader):
        self.model.train()
        total = 0.0
        for data in loader:
            if self.global_step % 16 == 0:
                self.occ.update(self.model)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", enabled=self.opt.fp16):
                preds, truths, loss = self.train_step(data)
                self.backward(loss)
            self.scheduler.step()
            self.global_step += 1
            total += loss.item()
        return total / len(loader)

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        psnrs = []
        for data in loader:
            rays_o, rays_d = data["rays_o"].to(self.device), data["rays_d"].to(self.device)
            gt = data["images"][..., :3].to(self.device)
            with torch.autocast("cuda", enabled=self.opt.fp16):
                out = render_rays(self.model, rays_o, rays_d, self.opt.near, self.opt.far, perturb=False)
            mse = ((out["image"].float() - gt) ** 2).mean()
            psnrs.append((-10 * torch.log10(mse)).item())
        self.model.train()
        return float(np.mean(psnrs))

    def save_checkpoint(self, path):
        torch.save({"model": {k: v.half() if v.is_floating_point() else v for k, v in self.model.state_dict().items()},
                    "occ": self.occ.grid, "step": self.global_step}, path)


def distill_proposal(model, loader, opt, steps=2000, device="cuda"):
    """Fit a small proposal density field to the trained model's weights (for faster sampling)."""
    prop = ProposalNet(bound=opt.bound).to(device)
    optimizer = torch.optim.Adam(prop.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-15)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if opt.fp16 else nullcontext()  # expect: AMP010
    model.eval()
    for step, data in zip(range(steps), loader):
        rays_o, rays_d = data["rays_o"].to(device), data["rays_d"].to(device)
        with torch.no_grad():
            teacher = render_rays(model, rays_o, rays_d, opt.near, opt.far, perturb=False)
        with amp_ctx:
            pred_sigma = prop(teacher["xyzs"].reshape(-1, 3)).view_as(teacher["weights"])
            loss = F.smooth_l1_loss(torch.log1p(pred_sigma), torch.log1p(teacher["weights"] * 100.0))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return prop


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=str)
    parser.add_argument("--workspace", type=str, default="workspace")
    parser.add_argument("--iters", type=int, default=30000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--bound", type=float, default=2.0)
    parser.add_argument("--near", type=float, default=0.2)
    parser.add_argument("--far", type=float, default=6.0)
    parser.add_argument("--lambda_mask", type=float, default=0.0)
    parser.add_argument("--clip_grad", type=float, default=1.0)
    opt = parser.parse_args()
    from nerf_data import NeRFDataset  # project-local loader (blender / colmap)

    train_loader = NeRFDataset(opt, split="train").dataloader()
    val_loader = NeRFDataset(opt, split="val").dataloader()
    trainer = NeRFTrainer(opt, NeRFNetwork(bound=opt.bound))
    epochs = math.ceil(opt.iters / len(train_loader))
    os.makedirs(opt.workspace, exist_ok=True)
    for epoch in range(epochs):
        loss = trainer.train_one_epoch(train_loader)
        if epoch % 10 == 0:
            print(f"epoch {epoch} loss {loss:.5f} psnr {trainer.evaluate(val_loader):.2f}")
    trainer.save_checkpoint(os.path.join(opt.workspace, "ngp.pth"))
    prop = distill_proposal(trainer.model, train_loader, opt)
    torch.save(prop.state_dict(), os.path.join(opt.workspace, "proposal.pth"))


if __name__ == "__main__":
    main()
