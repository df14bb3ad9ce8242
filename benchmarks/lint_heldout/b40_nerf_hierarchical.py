"""NeRF with hierarchical (coarse-to-fine) sampling.

Two MLP fields (coarse / fine) with positional encoding and a skip connection, density
through a truncated exponential (torch-ngp), optional NeRF-W style transient density,
alpha compositing along each ray, and inverse-CDF resampling of the fine samples.
"""
import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function


class _TruncExp(Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, g):
        x = ctx.saved_tensors[0]
        return g * torch.exp(x.clamp(-15, 15))


trunc_exp = _TruncExp.apply

DENSITY_ACTS = {
    "trunc_exp": trunc_exp,
    "relu": F.relu,
    "softplus": lambda x: F.softplus(x - 1.0),
}


@dataclass
class NeRFConfig:
    n_coarse: int = 64
    n_fine: int = 128
    pos_freqs: int = 10
    dir_freqs: int = 4
    density_act: str = "trunc_exp"
    transient: bool = False
    white_bkgd: bool = True
    perturb: bool = True


@dataclass
class RenderOutput:
    rgb_coarse: torch.Tensor
    rgb_fine: torch.Tensor
    depth_fine: torch.Tensor
    acc_fine: torch.Tensor
    reg: torch.Tensor


class PositionalEncoding(nn.Module):
    def __init__(self, num_freqs):
        super().__init__()
        self.register_buffer("freqs", 2.0 ** torch.arange(num_freqs) * math.pi, persistent=False)
        self.out_dim = 3 + 6 * num_freqs

    def forward(self, x):
        xb = x[..., None] * self.freqs
        return torch.cat([x, xb.sin().flatten(-2), xb.cos().flatten(-2)], dim=-1)


class NeRFField(nn.Module):
    def __init__(self, cfg, depth=8, width=256, skips=(4,)):
        super().__init__()
        self.pos_enc = PositionalEncoding(cfg.pos_freqs)
        self.dir_enc = PositionalEncoding(cfg.dir_freqs)
        in_pos = self.pos_enc.out_dim
        self.skips = set(skips)
        self.layers = nn.ModuleList()
        d = in_pos
        for i in range(depth):
            self.layers.append(nn.Linear(d + (in_pos if i in self.skips else 0), width))
            d = width
        self.sigma_out = nn.Linear(width, 1)
        self.feature = nn.Linear(width, width)
        self.rgb_net = nn.Sequential(
            nn.Linear(width + self.dir_enc.out_dim, width // 2), nn.ReLU(inplace=True), nn.Linear(width // 2, 3)
        )
        self.density_act = DENSITY_ACTS[cfg.density_act]
        self.transient = cfg.transient
        if cfg.transient:
            self.transient_sigma = nn.Linear(width, 1)

    def forward(self, pts, dirs):
        dtype = self.sigma_out.weight.dtype  # fp16 under --half-precision
        x = self.pos_enc(pts).to(dtype)
        h = x
        for i, layer in enumerate(self.layers):
            if i in self.skips:
                h = torch.cat([x, h], dim=-1)
            h = F.relu(layer(h))
        sigma = self.density_act(self.sigma_out(h).squeeze(-1))
        rgb = torch.sigmoid(self.rgb_net(torch.cat([self.feature(h), self.dir_enc(dirs).to(dtype)], dim=-1)))
        out = {"sigma": sigma, "rgb": rgb}
        if self.transient:
            t_sigma = F.relu(self.transient_sigma(h).squeeze(-1))
            out["sigma"] = sigma + t_sigma
            out["transient_reg"] = t_sigma.mean()  # expect: AMP004
        return out


def volume_render(sigma, rgb, z_vals, rays_d, white_bkgd=False):
    dists = z_vals[..., 1:] - z_vals[..., :-1]
    dists = torch.cat([dists, torch.tensor([1e10], device=dists.device).expand(dists[..., :1].shape)], dim=-1)
    dists = dists * torch.norm(rays_d[..., None, :], dim=-1)
    alpha = 1.0 - torch.exp(-sigma * dists)
    ones = torch.ones_like(alpha[..., :1])
    trans = torch.cumprod(torch.cat([ones, 1.0 - alpha + 1e-10], dim=-1), dim=-1)[..., :-1]
    weights = alpha * trans
    rgb_map = torch.sum(weights[..., None] * rgb, dim=-2)
    depth_map = torch.sum(weights * z_vals, dim=-1)
    acc_map = torch.sum(weights, dim=-1)
    if white_bkgd:
        rgb_map = rgb_map + (1.0 - acc_map[..., None])
    return rgb_map, depth_map, acc_map, weights


@torch.no_grad()
def sample_pdf(bins, weights, n_samples, det=False):
    weights = weights + 1e-5
    pdf = weights / torch.sum(weights, dim=-1, keepdim=True)
    cdf = torch.cumsum(pdf, dim=-1)
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], dim=-1)
    if det:
        u = torch.linspace(0.0, 1.0, n_samples, device=cdf.device).expand(*cdf.shape[:-1], n_samples)
    else:
        u = torch.rand(*cdf.shape[:-1], n_samples, device=cdf.device)
    inds = torch.searchsorted(cdf, u.contiguous(), right=True)
    below = (inds - 1).clamp(min=0)
    above = inds.clamp(max=cdf.shape[-1] - 1)
    idx = torch.stack([below, above], dim=-1)
    shape = [*idx.shape[:-1], cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(-2).expand(shape), -1, idx)
    bins_g = torch.gather(bins.unsqueeze(-2).expand(shape), -1, idx)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    t = (u - cdf_g[..., 0]) / denom
    return bins_g[..., 0] + t * (bins_g[..., 1] - bins_g[..., 0])


class NeRFSystem(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.coarse = NeRFField(cfg, width=128)
        self.fine = NeRFField(cfg, width=256)

    @staticmethod
    def _points(rays_o, rays_d, z_vals):
        pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
        dirs = F.normalize(rays_d, dim=-1)[..., None, :].expand_as(pts)
        return pts, dirs

    def forward(self, rays_o, rays_d, near, far):
        t = torch.linspace(0.0, 1.0, self.cfg.n_coarse, device=rays_o.device)
        z_vals = (near * (1.0 - t) + far * t).expand(rays_o.shape[0], self.cfg.n_coarse)
        if self.training and self.cfg.perturb:
            mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
            upper = torch.cat([mids, z_vals[..., -1:]], dim=-1)
            lower = torch.cat([z_vals[..., :1], mids], dim=-1)
            z_vals = lower + (upper - lower) * torch.rand_like(z_vals)
        out_c = self.coarse(*self._points(rays_o, rays_d, z_vals))
        rgb_c, _, _, w_c = volume_render(out_c["sigma"], out_c["rgb"], z_vals, rays_d, self.cfg.white_bkgd)

        z_mid = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
        z_fine = sample_pdf(z_mid, w_c[..., 1:-1].detach(), self.cfg.n_fine, det=not self.training)
        z_all, _ = torch.sort(torch.cat([z_vals, z_fine], dim=-1), dim=-1)
        out_f = self.fine(*self._points(rays_o, rays_d, z_all))
        rgb_f, depth_f, acc_f, _ = volume_render(out_f["sigma"], out_f["rgb"], z_all, rays_d, self.cfg.white_bkgd)
        reg = out_c.get("transient_reg", 0.0) + out_f.get("transient_reg", 0.0)
        return RenderOutput(rgb_c, rgb_f, depth_f, acc_f, reg)


def synthetic_rays(n_rays=1 << 16, chunk=4096):
    origins = F.normalize(torch.randn(n_rays, 3), dim=-1) * 4.0
    targets = torch.randn(n_rays, 3) * 0.5
    dirs = F.normalize(targets - origins, dim=-1)
    colors = torch.sigmoid(targets * 3.0)
    data = torch.utils.data.TensorDataset(origins, dirs, colors)
    return torch.utils.data.DataLoader(data, batch_size=chunk, shuffle=True, drop_last=True)


def train(model, loader, optimizer, scaler, args):
    model.train()
    for it, (rays_o, rays_d, target) in enumerate(loader):
        rays_o, rays_d, target = rays_o.cuda(), rays_d.cuda(), target.cuda()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            out = model(rays_o, rays_d, args.near, args.far)
            loss = F.mse_loss(out.rgb_coarse, target) + F.mse_loss(out.rgb_fine, target)
            loss = loss + args.transient_weight * out.reg
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if it % 100 == 0:
            psnr = -10.0 * torch.log10(F.mse_loss(out.rgb_fine.detach().float(), target))
            print(f"it {it} loss {loss.item():.5f} psnr {psnr.item():.2f} depth {out.depth_fine.float().mean().item():.2f}")


def benchmark(model, loader, args, iters=20):
    """Rays per second of a full forward + backward pass."""
    scaler = torch.amp.GradScaler("cuda")
    rays_o, rays_d, _ = (t.cuda() for t in next(iter(loader)))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(rays_o, rays_d, args.near, args.far)
            loss = out.rgb_fine.float().square().mean()
            scaler.scale(loss).backward()  # expect: AMP008
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return iters * rays_o.shape[0] / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--half-precision", action="store_true", help="pure fp16 weights (no autocast)")
    parser.add_argument("--transient", action="store_true")
    parser.add_argument("--transient-weight", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--near", type=float, default=2.0)
    parser.add_argument("--far", type=float, default=6.0)
    parser.add_argument("--benchmark", action="store_true")
    args = parser.parse_args()

    cfg = NeRFConfig(transient=args.transient)
    model = NeRFSystem(cfg).cuda()
    if args.half_precision:
        model = model.half()
        args.amp = False
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.1 ** (1 / args.epochs))
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    loader = synthetic_rays()
    if args.benchmark:
        print(f"{benchmark(model, loader, args):.0f} rays/s")
        return
    for epoch in range(args.epochs):
        train(model, loader, optimizer, scaler, args)
        scheduler.step()
        raw = model.module if hasattr(model, "module") else model
        torch.save({"model": raw.state_dict(), "cfg": cfg}, f"nerf_{epoch:03d}.pt")


if __name__ == "__main__":
    main()
