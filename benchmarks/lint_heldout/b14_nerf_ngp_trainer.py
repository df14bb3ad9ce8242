"""Instant-NGP style NeRF: multiresolution hash encoding, tiny MLPs, occupancy grid.

Trains on posed images (Blender synthetic format) with fp16 autocast.
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from nerf_data import BlenderRays  # local module


@dataclass
class TrainConfig:
    data_dir: str = "data/nerf_synthetic/lego"
    workspace: str = "runs/ngp_lego"
    iters: int = 30000
    lr: float = 1e-2
    num_rays: int = 4096
    num_steps: int = 512
    bound: float = 1.0
    grid_size: int = 128
    update_grid_every: int = 16
    fp16: bool = True
    eval_every: int = 2500


class _TruncExp(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        x = ctx.saved_tensors[0]
        return g * torch.exp(x.clamp(-15, 15))


trunc_exp = _TruncExp.apply


class HashEncoding(nn.Module):
    PRIMES = (1, 2654435761, 805459861)

    def __init__(self, n_levels=16, n_features=2, log2_size=19, base_res=16, max_res=2048):
        super().__init__()
        self.n_levels = n_levels
        self.table_size = 2 ** log2_size
        growth = math.exp((math.log(max_res) - math.log(base_res)) / (n_levels - 1))
        res = torch.tensor([math.floor(base_res * growth ** lvl) for lvl in range(n_levels)], dtype=torch.float32)
        self.register_buffer("resolutions", res, persistent=False)
        self.tables = nn.Parameter(torch.empty(n_levels, self.table_size, n_features).uniform_(-1e-4, 1e-4))
        corners = torch.tensor([[(i >> 2) & 1, (i >> 1) & 1, i & 1] for i in range(8)])
        self.register_buffer("corners", corners, persistent=False)
        self.output_dim = n_levels * n_features

    def _hash(self, coords):
        h = coords[..., 0] * self.PRIMES[0]
        h = h ^ (coords[..., 1] * self.PRIMES[1])
        h = h ^ (coords[..., 2] * self.PRIMES[2])
        return h % self.table_size

    def forward(self, x):
        feats = []
        for level in range(self.n_levels):
            pos = x * self.resolutions[level]
            base = pos.floor().long()
            frac = pos - base
            corner_idx = base[:, None, :] + self.corners[None]
            w = torch.where(self.corners[None].bool(), frac[:, None, :], 1.0 - frac[:, None, :]).prod(-1)
            vals = self.tables[level][self._hash(corner_idx)]
            feats.append((w[..., None] * vals).sum(1))
        return torch.cat(feats, dim=-1)


class NeRFNetwork(nn.Module):
    def __init__(self, bound=1.0, grid_size=128, hidden=64, geo_feat_dim=15, dir_freqs=4):
        super().__init__()
        self.bound = bound
        self.grid_size = grid_size
        self.dir_freqs = dir_freqs
        self.encoder = HashEncoding()
        self.sigma_net = nn.Sequential(
            nn.Linear(self.encoder.output_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 1 + geo_feat_dim)
        )
        dir_dim = 3 + 3 * 2 * dir_freqs
        self.color_net = nn.Sequential(
            nn.Linear(dir_dim + geo_feat_dim, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 3),
        )
        self.register_buffer("density_grid", torch.zeros(grid_size ** 3))
        self.mean_density = 0.0
        self.density_thresh = 0.01
        self.cell_weights = None

    def get_params(self, lr):
        return [{"params": self.encoder.parameters(), "lr": lr},
                {"params": list(self.sigma_net.parameters()) + list(self.color_net.parameters()), "lr": lr}]

    def encode_dirs(self, d):
        d = d / torch.linalg.norm(d, dim=-1, keepdim=True)
        out = [d]
        for i in range(self.dir_freqs):
            out += [torch.sin((2.0 ** i) * d), torch.cos((2.0 ** i) * d)]
        return torch.cat(out, dim=-1)

    def density(self, x):
        x = (x + self.bound) / (2 * self.bound)
        h = self.sigma_net(self.encoder(x.clamp(0.0, 1.0)))
        return {"sigma": trunc_exp(h[..., 0]), "geo_feat": h[..., 1:]}

    def forward(self, x, d):
        out = self.density(x)
        h = torch.cat([self.encode_dirs(d), out["geo_feat"]], dim=-1)
        return out["sigma"], torch.sigmoid(self.color_net(h))

    def _cell_index(self, xyz):
        ijk = ((xyz + self.bound) / (2 * self.bound) * self.grid_size).long().clamp(0, self.grid_size - 1)
        return (ijk[..., 0] * self.grid_size + ijk[..., 1]) * self.grid_size + ijk[..., 2]

    def render(self, rays_o, rays_d, bg_color=1.0, perturb=False, num_steps=512):
        n = rays_o.shape[0]
        near, far = 2.0 - self.bound, 2.0 + self.bound
        z = torch.linspace(0.0, 1.0, num_steps, device=rays_o.device)[None].expand(n, -1)
        z_vals = near + (far - near) * z
        sample_dist = (far - near) / num_steps
        if perturb:
            z_vals = z_vals + (torch.rand_like(z_vals) - 0.5) * sample_dist
        xyz = rays_o[:, None, :] + rays_d[:, None, :] * z_vals[..., None]
        dirs = rays_d[:, None, :].expand_as(xyz)
        sigma, rgb = self(xyz.reshape(-1, 3), dirs.reshape(-1, 3))
        sigma = sigma.view(n, num_steps)
        rgb = rgb.view(n, num_steps, 3)
        occupied = self.density_grid[self._cell_index(xyz)] > min(self.mean_density, self.density_thresh)
        sigma = sigma * occupied
        deltas = torch.cat([z_vals[:, 1:] - z_vals[:, :-1], torch.full_like(z_vals[:, :1], sample_dist)], dim=-1)
        alphas = 1.0 - torch.exp(-deltas * sigma)
        alphas_shifted = torch.cat([torch.ones_like(alphas[:, :1]), 1.0 - alphas + 1e-15], dim=-1)
        weights = alphas * torch.cumprod(alphas_shifted, dim=-1)[:, :-1]
        weights_sum = weights.sum(dim=-1)
        depth = (weights * z_vals).sum(dim=-1)
        image = (weights[..., None] * rgb).sum(dim=-2)
        image = image + (1.0 - weights_sum)[..., None] * bg_color
        return {"image": image, "depth": depth, "weights_sum": weights_sum}

    @torch.no_grad()
    def update_density_grid(self, decay=0.95, chunk=2 ** 18):
        res = self.grid_size
        # a 256^3 temporary grid in half precision keeps this pass under 100 MB
        tmp_grid = torch.zeros(res ** 3, dtype=torch.float16, device=self.density_grid.device)
        idx = torch.arange(res ** 3, device=tmp_grid.device)
        for start in range(0, res ** 3, chunk):
            cell = idx[start:start + chunk]
            ijk = torch.stack([cell // (res * res), (cell // res) % res, cell % res], dim=-1).float()
            xyz = (ijk + torch.rand_like(ijk)) / res * 2 * self.bound - self.bound
            tmp_grid[cell] = self.density(xyz)["sigma"].reshape(-1)
        valid = self.density_grid >= 0
        self.density_grid[valid] = torch.maximum(self.density_grid[valid] * decay, tmp_grid[valid].float())
        occ = tmp_grid.clamp(min=0)
        self.mean_density = torch.mean(occ).item()  # expect: AMP004
        self.cell_weights = occ / (occ.max() + 1e-10)  # expect: AMP011


class Trainer:
    def __init__(self, cfg: TrainConfig, model: NeRFNetwork, device):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.optimizer = torch.optim.Adam(self.model.get_params(cfg.lr), betas=(0.9, 0.99), eps=1e-15)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda it: 0.1 ** min(it / cfg.iters, 1))
        self.criterion = nn.MSELoss(reduction="none")
        self.fp16 = cfg.fp16
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.fp16)
        self.global_step = 0

    def train_step(self, data):
        rays_o = data["rays_o"].to(self.device)
        rays_d = data["rays_d"].to(self.device)
        images = data["images"].to(self.device)
        bg_color = torch.rand_like(images[..., :3])
        gt_rgb = images[..., :3] * images[..., 3:] + bg_color * (1.0 - images[..., 3:])

        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.fp16):
            outputs = self.model.render(rays_o, rays_d, bg_color=bg_color, perturb=True,
                                        num_steps=self.cfg.num_steps)
            loss = self.criterion(outputs["image"], gt_rgb).mean()
        if self.fp16:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
        self.optimizer.step()  # expect: AMP006
        self.scheduler.step()
        self.global_step += 1
        if self.global_step % self.cfg.update_grid_every == 0:
            self.model.update_density_grid()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        psnrs = []
        for data in loader:
            rays_o, rays_d = data["rays_o"].to(self.device), data["rays_d"].to(self.device)
            gt = data["images"][..., :3].to(self.device)
            with torch.cuda.amp.autocast(enabled=self.fp16):  # expect: AMP009
                outputs = self.model.render(rays_o, rays_d, bg_color=1.0, num_steps=self.cfg.num_steps)
            mse = F.mse_loss(outputs["image"].float(), gt)
            psnrs.append(-10.0 * math.log10(max(mse.item(), 1e-10)))
        self.model.train()
        return sum(psnrs) / max(1, len(psnrs))

    def save_checkpoint(self, name):
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "mean_density": self.model.mean_density,
            "step": self.global_step,
        }
        torch.save(state, os.path.join(self.cfg.workspace, f"{name}.pth"))


def profile_iterations(model, rays_o, rays_d, target, n_iters=20):
    """Rough forward+backward timing, used by --benchmark."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-15)
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(n_iters):
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            out = model.render(rays_o, rays_d, perturb=False)
            loss = F.mse_loss(out["image"], target)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.time() - t0) / n_iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default=TrainConfig.data_dir)
    p.add_argument("--workspace", default=TrainConfig.workspace)
    p.add_argument("--iters", type=int, default=TrainConfig.iters)
    p.add_argument("--no-fp16", action="store_true")
    p.add_argument("--benchmark", action="store_true")
    a = p.parse_args()
    cfg = TrainConfig(data_dir=a.data_dir, workspace=a.workspace, iters=a.iters, fp16=not a.no_fp16)
    os.makedirs(cfg.workspace, exist_ok=True)
    device = torch.device("cuda")
    model = NeRFNetwork(bound=cfg.bound, grid_size=cfg.grid_size)
    train_loader = DataLoader(BlenderRays(cfg.data_dir, "train", num_rays=cfg.num_rays), batch_size=None, shuffle=True)
    val_loader = DataLoader(BlenderRays(cfg.data_dir, "val", num_rays=None), batch_size=None)

    if a.benchmark:
        batch = next(iter(train_loader))
        ms = 1000 * profile_iterations(model.to(device), batch["rays_o"].to(device), batch["rays_d"].to(device),
                                       batch["images"][..., :3].to(device))
        print(f"{ms:.1f} ms / iteration")
        return

    trainer = Trainer(cfg, model, device)
    best_psnr = 0.0
    while trainer.global_step < cfg.iters:
        for data in train_loader:
            loss = trainer.train_step(data)
            if trainer.global_step % 100 == 0:
                print(f"step {trainer.global_step} loss {loss:.5f} mean_density {model.mean_density:.3f}")
            if trainer.global_step % cfg.eval_every == 0:
                psnr = trainer.evaluate(val_loader)
                print(f"val psnr {psnr:.2f}")
                if psnr > best_psnr:
                    best_psnr = psnr
                    trainer.save_checkpoint("best")
            if trainer.global_step >= cfg.iters:
                break
    trainer.save_checkpoint("final")


if __name__ == "__main__":
    main()
