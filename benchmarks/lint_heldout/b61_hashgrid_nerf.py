"""Instant-NGP style radiance field: multiresolution hash-grid encoding + tiny MLPs.

Pure-PyTorch reference of the fused CUDA version (used for debugging and CI); trains
with fp16 autocast + GradScaler like the tcnn build.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _TruncExp(torch.autograd.Function):
    # exp in fp32 with a clamped backward (density activation from torch-ngp)
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.exp(x.clamp(max=15))


trunc_exp = _TruncExp.apply


class HashGridEncoder(nn.Module):
    PRIMES = (1, 2654435761, 805459861)

    def __init__(self, n_levels=16, n_features=2, log2_table=19, base_res=16, max_res=2048):
        super().__init__()
        self.n_levels, self.table_size = n_levels, 2 ** log2_table
        self.out_dim = n_levels * n_features
        self.embeddings = nn.Parameter(torch.empty(n_levels, self.table_size, n_features).uniform_(-1e-4, 1e-4))
        growth = math.exp((math.log(max_res) - math.log(base_res)) / (n_levels - 1))
        res = [math.floor(base_res * growth ** lvl) for lvl in range(n_levels)]
        self.register_buffer("resolutions", torch.tensor(res, dtype=torch.float32))
        self.register_buffer("primes", torch.tensor(self.PRIMES, dtype=torch.int64))
        corners = [[(c >> i) & 1 for i in range(3)] for c in range(8)]
        self.register_buffer("corners", torch.tensor(corners, dtype=torch.int64))

    def _hash(self, coords):
        h = coords * self.primes
        return (h[..., 0] ^ h[..., 1] ^ h[..., 2]) % self.table_size

    def forward(self, x):  # x in [0, 1]^3, fp32
        feats = []
        for lvl in range(self.n_levels):
            pos = x * self.resolutions[lvl]
            p0 = pos.floor().long()
            frac = pos - p0.float()
            acc = 0.0
            for offs in self.corners:
                w = torch.where(offs.bool(), frac, 1.0 - frac).prod(dim=-1)
                acc = acc + w[..., None] * self.embeddings[lvl][self._hash(p0 + offs)]
            feats.append(acc)
        return torch.cat(feats, dim=-1)

    def tv_loss(self):
        return self.embeddings.pow(2).mean()


def sh_encode_deg2(d):
    x, y, z = d.unbind(-1)
    return torch.stack([
        0.28209479 * torch.ones_like(x), -0.48860251 * y, 0.48860251 * z, -0.48860251 * x,
        1.09254843 * x * y, -1.09254843 * y * z, 0.31539157 * (2 * z * z - x * x - y * y),
        -1.09254843 * x * z, 0.54627421 * (x * x - y * y),
    ], dim=-1)


def make_tiny_mlp(n_in, n_out, width=64, depth=2):
    layers = [nn.Linear(n_in, width, bias=False), nn.ReLU(inplace=True)]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width, bias=False), nn.ReLU(inplace=True)]
    layers.append(nn.Linear(width, n_out, bias=False))
    return nn.Sequential(*layers)


class RadianceField(nn.Module):
    def __init__(self, geo_dim=15, n_samples=128, bound=1.0, hdr=True):
        super().__init__()
        self.n_samples, self.bound, self.hdr = n_samples, bound, hdr
        self.encoder = HashGridEncoder()
        self.density_net = make_tiny_mlp(self.encoder.out_dim, 1 + geo_dim, depth=1)
        self.heads = nn.ModuleDict({
            "rgb": make_tiny_mlp(geo_dim + 9, 3, depth=2),
            "semantic": make_tiny_mlp(geo_dim, 8, depth=1),
        })
        self.register_buffer("density_grid", torch.zeros(128 ** 3))
        self.mean_density = 0.0

    def density(self, pts):
        h = self.density_net(self.encoder((pts + self.bound) / (2 * self.bound)))
        return trunc_exp(h[..., 0] - 1.0), h[..., 1:]

    def forward(self, rays_o, rays_d, near=0.05, far=2.0):
        t = torch.linspace(0.0, 1.0, self.n_samples, device=rays_o.device)
        z = near + (far - near) * t.expand(rays_o.shape[0], -1)
        if self.training:
            z = z + torch.rand_like(z) * (far - near) / self.n_samples
        pts = (rays_o[:, None] + rays_d[:, None] * z[..., None]).clamp(-self.bound, self.bound)
        sigma, geo = self.density(pts)
        d_enc = sh_encode_deg2(F.normalize(rays_d, dim=-1))[:, None].expand(-1, self.n_samples, -1)
        rgb = torch.sigmoid(self.heads["rgb"](torch.cat([geo, d_enc], dim=-1)))
        if self.hdr:  # inverse Reinhard: the head predicts tonemapped colour
            rgb = rgb / (1.0 - rgb + 1e-10)  # expect: AMP011
        sem = self.heads["semantic"](geo).softmax(dim=-1)

        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], dim=-1)
        alpha = 1.0 - torch.exp(-sigma * delta)
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], dim=-1), dim=-1)[:, :-1]
        weights = alpha * trans
        acc = weights.sum(dim=-1)
        depth = (weights * z).sum(dim=-1) / (acc + 1e-10)
        rgb_map = (weights[..., None] * rgb).sum(dim=-2)
        return {
            "rgb": rgb_map,
            "depth": depth,
            "acc": acc,
            "semantic": (weights[..., None] * sem).sum(dim=-2),
            "sample_var": rgb.var(dim=-2).sum(dim=-1),  # expect: AMP004
            "geo_l1": geo.abs().mean(),  # expect: AMP004
        }

    @torch.no_grad()
    def update_density_grid(self, decay=0.95, n=2 ** 16):
        idx = torch.randint(0, self.density_grid.numel(), (n,), device=self.density_grid.device)
        res = round(self.density_grid.numel() ** (1 / 3))
        ijk = torch.stack([idx // (res * res), (idx // res) % res, idx % res], dim=-1).float()
        pts = (ijk + torch.rand_like(ijk)) / res * 2 * self.bound - self.bound
        sigma, _ = self.density(pts)
        self.density_grid[idx] = torch.maximum(self.density_grid[idx] * decay, sigma)
        self.mean_density = self.density_grid.clamp(min=0).mean().item()


class RelativeL2Loss(nn.Module):
    """Loss of Neural Radiance Caching (Mueller et al. 2021): L2 relative to the prediction."""

    def forward(self, pred, target):
        return ((pred - target) ** 2 / (pred.detach() ** 2 + 0.01)).mean()


def train(args):
    field = RadianceField(hdr=not args.ldr).cuda()
    model = torch.compile(field) if args.compile else field
    grid_params = [field.encoder.embeddings]
    mlp_params = [p for n, p in field.named_parameters() if not n.startswith("encoder.")]
    optimizer = torch.optim.Adam(
        [{"params": grid_params, "weight_decay": 0.0}, {"params": mlp_params, "weight_decay": 1e-6}],
        lr=1e-2, betas=(0.9, 0.99), eps=1e-15,
    )
    scaler = torch.amp.GradScaler("cuda")
    criterion = RelativeL2Loss()
    images = torch.rand(100, 800, 800, 3)
    poses = torch.eye(4).repeat(100, 1, 1)
    for step in range(args.iters):
        i = torch.randint(0, images.shape[0], (1,)).item()
        pix = torch.randint(0, 800 * 800, (args.batch_rays,))
        target = images[i].view(-1, 3)[pix].cuda()
        rays_o = poses[i, :3, 3].expand(args.batch_rays, 3).cuda()
        rays_d = torch.randn(args.batch_rays, 3, device="cuda")

        with torch.autocast("cuda", dtype=torch.float16):
            if step % 16 == 0:
                field.update_density_grid()
            out = model(rays_o, rays_d)
            loss = criterion(out["rgb"], target) + 1e-4 * out["sample_var"].mean()
            loss = loss + 1e-5 * field.encoder.tv_loss() + 1e-4 * out["geo_l1"]

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 500 == 0:
            psnr = -10.0 * torch.log10(F.mse_loss(out["rgb"].float(), target))
            print(f"step {step} loss {loss.item():.5f} psnr {psnr.item():.2f} density {field.mean_density:.3f}")


@torch.no_grad()
def render_test_view(model, rays_o, rays_d, chunk=4096):
    model.eval()
    outs = []
    for s in range(0, rays_o.shape[0], chunk):
        with torch.autocast("cuda", dtype=torch.float16):
            outs.append(model(rays_o[s : s + chunk], rays_d[s : s + chunk])["rgb"])
    return torch.cat(outs).float()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=30000)
    p.add_argument("--batch_rays", type=int, default=4096)
    p.add_argument("--ldr", action="store_true", help="train on tonemapped targets")
    p.add_argument("--compile", action="store_true")
    train(p.parse_args())
