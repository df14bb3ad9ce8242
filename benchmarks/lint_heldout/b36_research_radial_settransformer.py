"""Radial set transformer for per-cloud property regression + point occupancy (research code).

Single-GPU script, fp16 autocast + GradScaler (V100s, no bf16). Modes:
  train     : full training
  probe     : linear probe on frozen features of a checkpoint
  bench     : fwd/bwd/step timing
  export    : TorchScript fp16 export for the inference server
"""
import argparse
import copy
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from pc_data import make_loaders  # project-local


class PointNorm(nn.Module):
    """LayerNorm written out by hand: we want to try per-cloud statistics next."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(dim=-1, keepdim=True)  # expect: AMP004
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class RadialAttention(nn.Module):
    def __init__(self, dim, heads=8):
        super().__init__()
        self.heads, self.dh = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.radius_head = nn.Linear(dim, heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, pos, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.dh)
        key_pad = ~mask[:, None, None, :].expand_as(scores)
        scores[key_pad] = -1e9  # expect: AMP007
        attn = scores.softmax(dim=-1)
        # learned per-point, per-head radius: attention decays with squared distance
        radius = self.radius_head(x).abs() + 1e-8  # expect: AMP011
        d2 = torch.cdist(pos, pos).pow(2)
        attn = attn * torch.exp(-d2[:, None] / radius.permute(0, 2, 1)[..., None])
        attn = attn / (attn.sum(dim=-1, keepdim=True) + 1e-6)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, -1))


class SetBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = RadialAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.density = nn.Linear(dim, 1)

    def forward(self, x, pos, mask):
        x = x + self.attn(self.norm1(x), pos, mask)
        h = self.mlp(self.norm2(x))
        # divide out a learned local density so dense regions do not dominate the residual
        dens = self.density(h).abs()
        return x + h / (dens + 1e-8)  # expect: AMP011


class EnsembleHead(nn.Module):
    def __init__(self, dim, k=8):
        super().__init__()
        self.heads = nn.Linear(dim, k)

    def forward(self, g):
        preds = self.heads(g)
        mu = preds.mean(dim=-1)  # expect: AMP004
        sigma = preds.std(dim=-1)  # expect: AMP004
        return mu, sigma


class RadialSetTransformer(nn.Module):
    def __init__(self, in_dim=4, dim=256, depth=6, heads=8):
        super().__init__()
        self.embed = nn.Linear(in_dim + 3, dim)
        self.in_norm = PointNorm(dim)
        self.blocks = nn.ModuleList([SetBlock(dim, heads) for _ in range(depth)])
        self.pre_pool = nn.Linear(dim, dim)
        self.ens = EnsembleHead(3 * dim)
        self.occ_head = nn.Linear(dim, 1)

    def features(self, pos, feats, mask):
        # log-intensity: raw LiDAR intensities span five orders of magnitude
        feats = torch.cat([torch.log(feats[..., :1].clamp_min(0) + 1e-8), feats[..., 1:]], dim=-1)
        h = self.in_norm(self.embed(torch.cat([pos, feats], dim=-1)))
        for blk in self.blocks:
            h = blk(h, pos, mask)
        return h

    def forward(self, pos, feats, mask):
        h = self.features(pos, feats, mask)
        z = self.pre_pool(h)
        m = mask.unsqueeze(-1).to(z.dtype)
        g_max = z.masked_fill(~mask[..., None], -1e4).amax(dim=1)
        g_sum = (z * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        g_avg = z.mean(dim=1)  # expect: AMP004
        mu, sigma = self.ens(torch.cat([g_max, g_sum, g_avg], dim=-1))
        occ = torch.sigmoid(self.occ_head(h)).squeeze(-1)
        return {"mu": mu, "sigma": sigma, "occ": occ}


def build_model(args):
    return RadialSetTransformer(in_dim=args.in_dim, dim=args.dim, depth=args.depth)


def gaussian_nll_loss(mu, sigma, y):
    var = sigma.pow(2) + 1e-6
    return 0.5 * (torch.log(var) + (y - mu).pow(2) / var).mean()


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    err, n = 0.0, 0
    for pos, feats, mask, y, _ in loader:
        out = model(pos.cuda(), feats.cuda(), mask.cuda())
        err += (out["mu"].float() - y.cuda()).abs().sum().item()
        n += y.numel()
    model.train()
    return err / n


def train(args):
    train_loader, val_loader = make_loaders(args)
    model = build_model(args).cuda()
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    best = float("inf")
    for epoch in range(args.epochs):
        for it, (pos, feats, mask, y, occ) in enumerate(train_loader):
            pos, feats, mask, y, occ = (t.cuda(non_blocking=True) for t in (pos, feats, mask, y, occ))
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(pos, feats, mask)
                occ_loss = F.binary_cross_entropy(out["occ"][mask], occ[mask].float())  # expect: AMP003
            reg_loss = gaussian_nll_loss(out["mu"], out["sigma"], y)  # expect: AMP002
            loss = reg_loss + args.occ_weight * occ_loss
            if it % 50 == 0:
                print(f"ep {epoch} it {it} reg {reg_loss.item():.4f} occ {occ_loss.item():.4f} scale {scaler.get_scale():.0f}")
            loss = scaler.scale(loss)
            loss.backward()
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
        val_mae = evaluate(model, val_loader)
        print(f"epoch {epoch} val MAE {val_mae:.4f}")
        if val_mae < best:
            best = val_mae
            torch.save(model.state_dict(), args.ckpt)


def linear_probe(args):
    train_loader, val_loader = make_loaders(args)
    model = build_model(args)
    model.load_state_dict(torch.load(args.ckpt, map_location="cpu"))
    backbone = copy.deepcopy(model).half().cuda().eval()
    backbone.requires_grad_(False)
    probe = nn.Linear(args.dim, args.n_classes).cuda()
    opt = torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.probe_epochs):
        for pos, feats, mask, _, labels in train_loader:
            pos, feats, mask, labels = pos.cuda(), feats.cuda(), mask.cuda(), labels.cuda()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                h = backbone.features(pos, feats, mask)
                pooled = h.float().sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(probe(pooled), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        print(f"probe epoch {epoch} loss {loss.item():.4f}")


def benchmark(model, loader, iters=50):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    pos, feats, mask, y, _ = (t.cuda() for t in next(iter(loader)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(pos, feats, mask)
            loss = (out["mu"].float() - y).pow(2).mean()
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"{(time.perf_counter() - t0) / iters * 1000:.1f} ms/iter")


def export_torchscript(args):
    model = build_model(args)
    model.load_state_dict(torch.load(args.ckpt, map_location="cpu"))
    scripted = torch.jit.script(copy.deepcopy(model).half().eval())
    scripted.save(args.ckpt.replace(".pt", "_fp16.ts"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "probe", "bench", "export"])
    p.add_argument("--data", default="data/clouds")
    p.add_argument("--ckpt", default="runs/rst.pt")
    p.add_argument("--in_dim", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--n_classes", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--occ_weight", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--probe_epochs", type=int, default=10)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    if args.mode == "train":
        train(args)
    elif args.mode == "probe":
        linear_probe(args)
    elif args.mode == "bench":
        _, loader = make_loaders(args)
        benchmark(build_model(args).cuda(), loader)
    else:
        export_torchscript(args)
