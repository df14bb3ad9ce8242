"""NeRF with an occupancy proposal network (mip-NeRF 360 / UNISURF flavoured).

Trains on pre-computed rays of a Blender scene:
    python b51_nerf_renderer.py --rays data/lego_rays.npz --amp
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class PositionalEncoding(nn.Module):
    def __init__(self, n_freqs, include_input=True):
        super().__init__()
        freqs = 2.0 ** torch.arange(n_freqs, dtype=torch.float32) * math.pi
        self.register_buffer("freqs", freqs, persistent=False)
        self.include_input = include_input
        self.out_dim = 3 * (2 * n_freqs + int(include_input))

    def forward(self, x):
        xb = (x[..., None] * self.freqs).flatten(-2)
        enc = torch.cat([torch.sin(xb), torch.cos(xb)], dim=-1)
        return torch.cat([x, enc], dim=-1) if self.include_input else enc


class NeRFField(nn.Module):
    def __init__(self, depth=8, width=256, skips=(4,), pos_freqs=10, dir_freqs=4):
        super().__init__()
        self.pos_enc = PositionalEncoding(pos_freqs)
        self.dir_enc = PositionalEncoding(dir_freqs)
        in_ch = self.pos_enc.out_dim
        self.skips = skips
        layers = [nn.Linear(in_ch, width)]
        for i in range(depth - 1):
            layers.append(nn.Linear(width + (in_ch if i in skips else 0), width))
        self.pts_linears = nn.ModuleList(layers)
        self.sigma_head = nn.Linear(width, 1)
        self.feature = nn.Linear(width, width)
        self.rgb_branch = nn.Sequential(
            nn.Linear(width + self.dir_enc.out_dim, width // 2), nn.ReLU(inplace=True),
            nn.Linear(width // 2, 3),
        )

    def forward(self, pts, dirs):
        x = self.pos_enc(pts)
        h = x
        for i, layer in enumerate(self.pts_linears):
            h = F.relu(layer(h))
            if i in self.skips:
                h = torch.cat([x, h], dim=-1)
        sigma = F.relu(self.sigma_head(h)).squeeze(-1)
        feat = self.feature(h)
        rgb = torch.sigmoid(self.rgb_branch(torch.cat([feat, self.dir_enc(dirs)], dim=-1)))
        return sigma, rgb


class ProposalNetwork(nn.Module):
    """Tiny occupancy MLP that decides where the fine samples go."""

    def __init__(self, n_freqs=6, width=64):
        super().__init__()
        self.enc = PositionalEncoding(n_freqs)
        self.mlp = nn.Sequential(
            nn.Linear(self.enc.out_dim, width), nn.ReLU(inplace=True),
            nn.Linear(width, width), nn.ReLU(inplace=True),
            nn.Linear(width, 1),
        )

    def forward(self, pts):
        return torch.sigmoid(self.mlp(self.enc(pts))).squeeze(-1)


def occupancy_weights(occ):
    """UNISURF: w_i = o_i * prod_{j<i} (1 - o_j)."""
    trans = torch.cumprod(1.0 - occ + 1e-10, dim=-1)  # expect: AMP011
    trans = torch.cat([torch.ones_like(trans[..., :1]), trans[..., :-1]], dim=-1)
    return occ * trans


def volume_render(sigma, rgb, z_vals, rays_d, white_bkgd=False):
    dists = z_vals[..., 1:] - z_vals[..., :-1]
    dists = torch.cat([dists, torch.full_like(dists[..., :1], 1e10)], dim=-1)
    dists = dists * torch.norm(rays_d[..., None, :], dim=-1)
    alpha = 1.0 - torch.exp(-sigma * dists)
    ones = torch.ones_like(alpha[..., :1])
    trans = torch.cumprod(torch.cat([ones, 1.0 - alpha + 1e-10], dim=-1), dim=-1)[..., :-1]
    weights = alpha * trans
    rgb_map = (weights[..., None] * rgb).sum(dim=-2)
    depth_map = (weights * z_vals).sum(dim=-1)
    acc_map = weights.sum(dim=-1)
    disp_map = 1.0 / torch.max(1e-10 * torch.ones_like(depth_map), depth_map / acc_map)
    if white_bkgd:
        rgb_map = rgb_map + (1.0 - acc_map[..., None])
    return rgb_map, depth_map, acc_map, disp_map, weights


@torch.no_grad()
def sample_pdf(bins, weights, n_samples, det=False):
    weights = weights + 1e-5
    pdf = weights / torch.sum(weights, dim=-1, keepdim=True)
    cdf = torch.cumsum(pdf, dim=-1)
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], dim=-1)
    if det:
        u = torch.linspace(0.0, 1.0, steps=n_samples, device=cdf.device)
        u = u.expand(list(cdf.shape[:-1]) + [n_samples]).contiguous()
    else:
        u = torch.rand(list(cdf.shape[:-1]) + [n_samples], device=cdf.device)
    inds = torch.searchsorted(cdf, u, right=True)
    below = torch.clamp(inds - 1, min=0)
    above = torch.clamp(inds, max=cdf.shape[-1] - 1)
    inds_g = torch.stack([below, above], dim=-1)
    shape = [inds_g.shape[0], inds_g.shape[1], cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(1).expand(shape), 2, inds_g)
    bins_g = torch.gather(bins.unsqueeze(1).expand(shape), 2, inds_g)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    t = (u - cdf_g[..., 0]) / denom
    return bins_g[..., 0] + t * (bins_g[..., 1] - bins_g[..., 0])


class NeRFRenderer(nn.Module):
    def __init__(self, n_coarse=64, n_fine=128, near=2.0, far=6.0, white_bkgd=True):
        super().__init__()
        self.field = NeRFField()
        self.proposal = ProposalNetwork()
        self.n_coarse, self.n_fine = n_coarse, n_fine
        self.near, self.far = near, far
        self.white_bkgd = white_bkgd
        self.register_buffer("density_ema", torch.zeros(()))

    def forward(self, rays_o, rays_d):
        n_rays = rays_o.shape[0]
        viewdirs = rays_d / torch.norm(rays_d, dim=-1, keepdim=True)
        t_vals = torch.linspace(0.0, 1.0, steps=self.n_coarse, device=rays_o.device)
        z_vals = (self.near * (1.0 - t_vals) + self.far * t_vals).expand(n_rays, self.n_coarse)
        if self.training:
            mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
            upper = torch.cat([mids, z_vals[..., -1:]], dim=-1)
            lower = torch.cat([z_vals[..., :1], mids], dim=-1)
            z_vals = lower + (upper - lower) * torch.rand_like(z_vals)
        pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
        occ = self.proposal(pts)
        w_prop = occupancy_weights(occ)
        z_mid = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
        z_samples = sample_pdf(z_mid, w_prop[..., 1:-1].detach(), self.n_fine, det=not self.training)
        z_all, _ = torch.sort(torch.cat([z_vals, z_samples], dim=-1), dim=-1)
        pts_f = rays_o[..., None, :] + rays_d[..., None, :] * z_all[..., :, None]
        sigma, rgb = self.field(pts_f, viewdirs[..., None, :].expand_as(pts_f))
        rgb_map, depth_map, acc_map, disp_map, weights = volume_render(
            sigma, rgb, z_all, rays_d, self.white_bkgd)

        # regularisers (all returned to the trainer)
        sparsity = sigma.abs().mean()  # expect: AMP004
        cauchy = torch.log1p(2.0 * sigma ** 2).mean()
        occ_entropy = -(occ * torch.log(occ + 1e-10) + (1.0 - occ) * torch.log(1.0 - occ + 1e-10)).mean()  # expect: AMP011
        p = weights / (weights.sum(dim=-1, keepdim=True) + 1e-10)
        ray_entropy = -(p * torch.log(p + 1e-10)).sum(dim=-1).mean()
        w_coarse = weights.detach()[:, : self.n_coarse]
        prop_loss = F.relu(w_coarse - w_prop).pow(2).mean()
        if self.training:
            with torch.no_grad():
                self.density_ema.mul_(0.95).add_(0.05 * sigma.mean())  # expect: AMP004
        return {"rgb": rgb_map, "depth": depth_map, "acc": acc_map, "disp": disp_map,
                "sparsity": sparsity, "cauchy": cauchy, "entropy": ray_entropy,
                "occ_entropy": occ_entropy, "prop": prop_loss}


def build_renderer(args):
    return NeRFRenderer(n_coarse=args.n_coarse, n_fine=args.n_fine,
                        near=args.near, far=args.far, white_bkgd=True)


@torch.no_grad()
def render_test(model, rays_o, rays_d, gt, chunk=8192):
    model.eval()
    rgb = torch.cat([model(rays_o[i:i + chunk], rays_d[i:i + chunk])["rgb"]
                     for i in range(0, rays_o.shape[0], chunk)], dim=0)
    model.train()
    img = rgb.float().cpu().numpy()
    mse = np.mean((img - gt) ** 2)
    return -10.0 * np.log10(mse + 1e-10)


def export_for_viewer(model, path):
    # baked half-precision weights for the WebGL viewer
    viewer_model = copy.deepcopy(model).half().eval()
    torch.save(viewer_model.state_dict(), path)


def train(args):
    device = torch.device("cuda")
    data = np.load(args.rays)
    rays_o = torch.from_numpy(data["rays_o"]).float().to(device)
    rays_d = torch.from_numpy(data["rays_d"]).float().to(device)
    target = torch.from_numpy(data["rgb"]).float().to(device)
    model = build_renderer(args).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    best_psnr = -1e9
    for it in range(args.n_iters):
        idx = torch.randint(0, rays_o.shape[0], (args.batch_rays,), device=device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):  # expect: AMP010
            out = model(rays_o[idx], rays_d[idx])
            img_loss = F.mse_loss(out["rgb"], target[idx])
            loss = (img_loss + args.w_sparsity * out["sparsity"] + args.w_cauchy * out["cauchy"]
                    + args.w_entropy * (out["entropy"] + out["occ_entropy"]) + out["prop"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        decay = 0.1 ** (it / args.lr_decay_steps)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * decay
        if it % 100 == 0:
            psnr = -10.0 * torch.log10(img_loss.detach())
            print(f"[{it:06d}] loss {loss.item():.4f} psnr {psnr.item():.2f}")
        if it > 0 and it % args.val_every == 0:
            val = render_test(model, rays_o[:40000], rays_d[:40000], data["rgb"][:40000])
            if val > best_psnr:
                best_psnr = val
                torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
    export_for_viewer(model, os.path.join(args.out, "viewer_fp16.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rays", required=True)
    p.add_argument("--out", default="runs/nerf")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--n-iters", type=int, default=200000)
    p.add_argument("--batch-rays", type=int, default=4096)
    p.add_argument("--n-coarse", type=int, default=64)
    p.add_argument("--n-fine", type=int, default=128)
    p.add_argument("--near", type=float, default=2.0)
    p.add_argument("--far", type=float, default=6.0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lr-decay-steps", type=int, default=250000)
    p.add_argument("--w-sparsity", type=float, default=1e-4)
    p.add_argument("--w-cauchy", type=float, default=1e-4)
    p.add_argument("--w-entropy", type=float, default=1e-3)
    p.add_argument("--val-every", type=int, default=5000)
    train(p.parse_args())
