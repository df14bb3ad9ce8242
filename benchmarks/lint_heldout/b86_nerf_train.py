"""Minimal NeRF trainer for the Blender synthetic scenes (single MLP, no hierarchical sampling)."""
import argparse
import json
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class _TruncExp(torch.autograd.Function):
    """exp() whose gradient is clamped, as in instant-ngp."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.exp(x.clamp(-15, 15))


trunc_exp = _TruncExp.apply


def positional_encoding(x, n_freqs):
    freqs = 2.0 ** torch.arange(n_freqs, dtype=torch.float32, device=x.device)
    xb = x[..., None, :] * freqs[:, None] * math.pi
    enc = torch.cat([torch.sin(xb), torch.cos(xb)], dim=-1).flatten(-2)
    return torch.cat([x, enc], dim=-1)


class NeRFMLP(nn.Module):
    def __init__(self, pos_freqs=10, dir_freqs=4, width=256, depth=8):
        super().__init__()
        self.pos_freqs = pos_freqs
        self.dir_freqs = dir_freqs
        in_pos = 3 + 6 * pos_freqs
        in_dir = 3 + 6 * dir_freqs
        layers = [nn.Linear(in_pos, width), nn.ReLU(inplace=True)]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU(inplace=True)]
        layers.append(nn.Linear(width, width))
        self.trunk = nn.Sequential(*layers)
        self.sigma_head = nn.Linear(width, 1)
        self.feature_proj = nn.Linear(width, width)
        self.rgb_head = nn.Sequential(nn.Linear(width + in_dir, width // 2), nn.ReLU(inplace=True), nn.Linear(width // 2, 3))

    def forward(self, pts, dirs):
        enc = positional_encoding(pts, self.pos_freqs)
        h = F.relu(self.trunk(enc))
        sigma = trunc_exp(self.sigma_head(h).squeeze(-1) - 1.0)
        feat = self.feature_proj(h)
        # parameter-free layer norm on the geometry feature before the view branch
        feat = (feat - feat.mean(dim=-1, keepdim=True)) / (feat.std(dim=-1, keepdim=True) + 1e-5)  # expect: AMP004
        dir_enc = positional_encoding(dirs[..., None, :].expand_as(pts), self.dir_freqs)
        rgb = torch.sigmoid(self.rgb_head(torch.cat([feat, dir_enc], dim=-1)))
        return rgb, sigma


def sample_along_rays(rays_o, rays_d, near, far, n_samples, perturb):
    t = torch.linspace(0.0, 1.0, n_samples, device=rays_o.device)
    z_vals = near * (1.0 - t) + far * t
    z_vals = z_vals.expand(rays_o.shape[0], n_samples).contiguous()
    if perturb:
        mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
        upper = torch.cat([mids, z_vals[..., -1:]], dim=-1)
        lower = torch.cat([z_vals[..., :1], mids], dim=-1)
        z_vals = lower + (upper - lower) * torch.rand_like(z_vals)
    pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
    return pts, z_vals


def composite(rgb, sigma, z_vals, rays_d, white_bkgd=True):
    # alpha compositing is done in full precision: the transmittance product runs over every sample
    rgb, sigma = rgb.float(), sigma.float()
    dists = z_vals[..., 1:] - z_vals[..., :-1]
    dists = torch.cat([dists, dists[..., -1:]], dim=-1)
    dists = dists * torch.norm(rays_d[..., None, :], dim=-1)
    alpha = 1.0 - torch.exp(-sigma * dists)
    ones = torch.ones_like(alpha[..., :1])
    trans = torch.cumprod(torch.cat([ones, 1.0 - alpha + 1e-10], dim=-1), dim=-1)[..., :-1]
    weights = alpha * trans
    rgb_map = (weights[..., None] * rgb).sum(dim=-2)
    depth_map = (weights * z_vals).sum(dim=-1)
    acc_map = weights.sum(dim=-1)
    if white_bkgd:
        rgb_map = rgb_map + (1.0 - acc_map[..., None])
    return rgb_map, depth_map, acc_map


def load_blender(basedir, split, half_res=True):
    with open(os.path.join(basedir, f"transforms_{split}.json")) as fp:
        meta = json.load(fp)
    imgs, poses = [], []
    for frame in meta["frames"]:
        img = imageio.imread(os.path.join(basedir, frame["file_path"] + ".png"))
        imgs.append(img)
        poses.append(np.array(frame["transform_matrix"]))
    imgs = (np.stack(imgs) / 255.0).astype(np.float32)
    imgs = imgs[..., :3] * imgs[..., 3:] + (1.0 - imgs[..., 3:])
    poses = np.stack(poses).astype(np.float32)
    h, w = imgs.shape[1:3]
    focal = 0.5 * w / np.tan(0.5 * float(meta["camera_angle_x"]))
    if half_res:
        imgs = torch.from_numpy(imgs).permute(0, 3, 1, 2)
        imgs = F.interpolate(imgs, scale_factor=0.5, mode="area").permute(0, 2, 3, 1).numpy()
        h, w, focal = h // 2, w // 2, focal / 2.0
    return torch.from_numpy(imgs), torch.from_numpy(poses), (h, w, focal)


def get_rays(h, w, focal, c2w):
    i, j = torch.meshgrid(torch.arange(w, dtype=torch.float32), torch.arange(h, dtype=torch.float32), indexing="xy")
    dirs = torch.stack([(i - w * 0.5) / focal, -(j - h * 0.5) / focal, -torch.ones_like(i)], dim=-1)
    rays_d = (dirs[..., None, :] * c2w[:3, :3]).sum(dim=-1)
    rays_o = c2w[:3, -1].expand(rays_d.shape)
    return rays_o, rays_d


def train(args):
    device = torch.device("cuda")
    images, poses, (h, w, focal) = load_blender(args.datadir, "train")
    all_o, all_d = zip(*(get_rays(h, w, focal, p) for p in poses))
    rays_o = torch.stack(all_o).reshape(-1, 3)
    rays_d = torch.stack(all_d).reshape(-1, 3)
    colors = images.reshape(-1, 3)

    model = NeRFMLP(width=args.width).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    decay = 0.1 ** (1.0 / args.lr_decay_steps)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=decay)

    for it in range(1, args.iters + 1):
        idx = torch.randint(0, rays_o.shape[0], (args.batch_rays,))
        batch_o, batch_d = rays_o[idx].to(device), rays_d[idx].to(device)
        target_rgb = colors[idx].to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            pts, z_vals = sample_along_rays(batch_o, batch_d, args.near, args.far, args.n_samples, perturb=True)
            rgb, sigma = model(pts, batch_d / batch_d.norm(dim=-1, keepdim=True))
            rgb_map, _, _ = composite(rgb, sigma, z_vals, batch_d)
            loss = F.mse_loss(rgb_map, target_rgb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if it % args.log_every == 0:
            psnr = -10.0 * math.log10(max(loss.item(), 1e-10))
            print(f"iter {it:6d}  loss {loss.item():.5f}  psnr {psnr:.2f}")
    return model


@torch.no_grad()
def render_image(model, c2w, hwf, args, chunk=8192):
    h, w, focal = hwf
    rays_o, rays_d = get_rays(h, w, focal, c2w)
    rays_o, rays_d = rays_o.reshape(-1, 3).cuda(), rays_d.reshape(-1, 3).cuda()
    out = []
    for i in range(0, rays_o.shape[0], chunk):
        o, d = rays_o[i : i + chunk], rays_d[i : i + chunk]
        with torch.autocast("cuda", dtype=torch.float16):
            pts, z_vals = sample_along_rays(o, d, args.near, args.far, args.n_samples, perturb=False)
            rgb, sigma = model(pts, d / d.norm(dim=-1, keepdim=True))
        out.append(composite(rgb, sigma, z_vals, d)[0])
    return torch.cat(out).reshape(h, w, 3).clamp(0, 1).cpu()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--datadir", default="data/nerf_synthetic/lego")
    parser.add_argument("--iters", type=int, default=200_000)
    parser.add_argument("--batch-rays", type=int, default=1024)
    parser.add_argument("--n-samples", type=int, default=128)
    parser.add_argument("--near", type=float, default=2.0)
    parser.add_argument("--far", type=float, default=6.0)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--lr-decay-steps", type=int, default=250_000)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args()
    nerf = train(args)
    torch.save(nerf.state_dict(), os.path.join(args.datadir, "nerf.pt"))
