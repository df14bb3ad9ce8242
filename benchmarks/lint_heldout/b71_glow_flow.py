"""Multi-scale Glow: squeeze -> K x (ActNorm, invertible 1x1 conv (LU), affine
coupling) -> split with a learned conditional prior. A small conditional network
produces the dequantisation noise. Objective: negative log-likelihood in bits/dim.
"""
import argparse
import logging
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import linalg as la
from torchvision.utils import save_image

from flows.data import get_image_loaders

logger = logging.getLogger("glow")

GLOW_CFGS = {
    "cifar10": {"in_ch": 3, "n_flow": 32, "n_block": 3, "hidden": 512, "affine": True, "img_size": 32},
    "celeba64": {"in_ch": 3, "n_flow": 32, "n_block": 4, "hidden": 512, "affine": True, "img_size": 64},
    "mnist": {"in_ch": 1, "n_flow": 16, "n_block": 2, "hidden": 256, "affine": False, "img_size": 32},
}


def logabs(x):
    return torch.log(torch.abs(x))


def gaussian_log_p(x, mean, log_sd):
    return -0.5 * math.log(2 * math.pi) - log_sd - 0.5 * (x - mean) ** 2 / torch.exp(2 * log_sd)


class ActNorm(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, ch, 1, 1))
        self.logs = nn.Parameter(torch.zeros(1, ch, 1, 1))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    @torch.no_grad()
    def initialize(self, x):
        flat = x.detach().float().permute(1, 0, 2, 3).reshape(x.shape[1], -1)
        mean = flat.mean(dim=1).view(1, -1, 1, 1)
        std = flat.std(dim=1).view(1, -1, 1, 1)
        self.loc.data.copy_(-mean)
        self.logs.data.copy_(torch.log(1.0 / (std + 1e-6)))
        self.initialized.fill_(1)

    def forward(self, x):
        _, _, h, w = x.shape
        if self.initialized.item() == 0:
            self.initialize(x)
        logdet = h * w * self.logs.sum()
        return torch.exp(self.logs) * (x + self.loc), logdet

    def reverse(self, y):
        return y * torch.exp(-self.logs) - self.loc


class InvConv2dLU(nn.Module):
    def __init__(self, ch):
        super().__init__()
        q, _ = la.qr(np.random.randn(ch, ch))
        w_p, w_l, w_u = la.lu(q.astype(np.float32))
        w_s = np.diag(w_u)
        w_u = np.triu(w_u, 1)
        u_mask = np.triu(np.ones_like(w_u), 1)
        self.register_buffer("w_p", torch.from_numpy(w_p.copy()))
        self.register_buffer("u_mask", torch.from_numpy(u_mask.copy()))
        self.register_buffer("l_mask", torch.from_numpy(u_mask.T.copy()))
        self.register_buffer("s_sign", torch.sign(torch.from_numpy(w_s.copy())))
        self.register_buffer("l_eye", torch.eye(ch))
        self.w_l = nn.Parameter(torch.from_numpy(w_l.copy()))
        self.w_s = nn.Parameter(logabs(torch.from_numpy(w_s.copy())))
        self.w_u = nn.Parameter(torch.from_numpy(w_u.copy()))

    def calc_weight(self):
        weight = self.w_p @ (self.w_l * self.l_mask + self.l_eye) @ (
            self.w_u * self.u_mask + torch.diag(self.s_sign * torch.exp(self.w_s))
        )
        return weight.unsqueeze(2).unsqueeze(3)

    def forward(self, x):
        _, _, h, w = x.shape
        out = F.conv2d(x, self.calc_weight())
        return out, h * w * torch.sum(self.w_s)

    def reverse(self, y):
        weight = self.calc_weight().squeeze()
        return F.conv2d(y, weight.double().inverse().float().unsqueeze(2).unsqueeze(3))


class AffineCoupling(nn.Module):
    def __init__(self, ch, hidden=512):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(ch // 2, hidden, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(hidden, hidden, 1), nn.ReLU(inplace=True),
            nn.Conv2d(hidden, ch, 3, padding=1),
        )
        self.net[0].weight.data.normal_(0, 0.05)
        self.net[0].bias.data.zero_()
        self.net[2].weight.data.normal_(0, 0.05)
        self.net[2].bias.data.zero_()
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x):
        x_a, x_b = x.chunk(2, 1)
        log_s, t = self.net(x_a).chunk(2, 1)
        s = torch.sigmoid(log_s + 2.0)
        y_b = (x_b + t) * s
        logdet = torch.log(s + 1e-10).flatten(1).sum(1)  # expect: AMP011
        return torch.cat([x_a, y_b], 1), logdet

    def reverse(self, y):
        y_a, y_b = y.chunk(2, 1)
        log_s, t = self.net(y_a).chunk(2, 1)
        s = torch.sigmoid(log_s + 2.0)
        return torch.cat([y_a, y_b / s - t], 1)


class AdditiveCoupling(AffineCoupling):
    def __init__(self, ch, hidden=512):
        super().__init__(ch, hidden)
        self.net[-1] = nn.Conv2d(hidden, ch // 2, 3, padding=1)
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x):
        x_a, x_b = x.chunk(2, 1)
        return torch.cat([x_a, x_b + self.net(x_a)], 1), torch.zeros(x.shape[0], device=x.device)

    def reverse(self, y):
        y_a, y_b = y.chunk(2, 1)
        return torch.cat([y_a, y_b - self.net(y_a)], 1)


class FlowStep(nn.Module):
    def __init__(self, ch, hidden, affine=True):
        super().__init__()
        self.actnorm = ActNorm(ch)
        self.invconv = InvConv2dLU(ch)
        self.coupling = AffineCoupling(ch, hidden) if affine else AdditiveCoupling(ch, hidden)

    def forward(self, x):
        out, logdet = self.actnorm(x)
        out, det1 = self.invconv(out)
        out, det2 = self.coupling(out)
        return out, logdet + det1 + det2

    def reverse(self, y):
        return self.actnorm.reverse(self.invconv.reverse(self.coupling.reverse(y)))


class Block(nn.Module):
    def __init__(self, in_ch, n_flow, hidden, split=True, affine=True):
        super().__init__()
        sq = in_ch * 4
        self.flows = nn.ModuleList([FlowStep(sq, hidden, affine) for _ in range(n_flow)])
        self.split = split
        self.prior = nn.Conv2d(in_ch * 2, in_ch * 4, 3, padding=1) if split else nn.Conv2d(sq, sq * 2, 3, padding=1)
        nn.init.zeros_(self.prior.weight)
        nn.init.zeros_(self.prior.bias)

    def forward(self, x):
        b, c, h, w = x.shape
        out = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        logdet = 0
        for flow in self.flows:
            out, det = flow(out)
            logdet = logdet + det
        if self.split:
            out, z_new = out.chunk(2, 1)
            mean, log_sd = self.prior(out).chunk(2, 1)
        else:
            z_new = out
            mean, log_sd = self.prior(torch.zeros_like(out)).chunk(2, 1)
        log_p = gaussian_log_p(z_new.float(), mean.float(), log_sd.float()).flatten(1).sum(1)
        return out, logdet, log_p, z_new


class Dequantizer(nn.Module):
    """u = sigmoid(f(x, eps)), eps ~ N(0, I); returns x + u on the [0, 1] grid and log q(u | x)."""

    def __init__(self, ch=3, hidden=96):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(ch * 2, hidden, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(hidden, hidden, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(hidden, ch, 3, padding=1),
        )

    def forward(self, x, n_bins=256):
        eps = torch.randn_like(x)
        u = torch.sigmoid(self.net(torch.cat([x, eps], dim=1)))
        log_u = torch.log(u + 1e-8)  # expect: AMP011
        log_1mu = torch.log(1.0 - u + 1e-8)  # expect: AMP011
        log_q = (-0.5 * eps.pow(2) - 0.5 * math.log(2 * math.pi) - log_u - log_1mu).flatten(1).sum(1)
        return (x * (n_bins - 1) + u) / n_bins, log_q


class Glow(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dequant = Dequantizer(cfg["in_ch"])
        blocks, ch = [], cfg["in_ch"]
        for _ in range(cfg["n_block"] - 1):
            blocks.append(Block(ch, cfg["n_flow"], cfg["hidden"], split=True, affine=cfg["affine"]))
            ch *= 2
        blocks.append(Block(ch, cfg["n_flow"], cfg["hidden"], split=False, affine=cfg["affine"]))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        x, log_q = self.dequant(x)
        out = x - 0.5
        log_p_sum, logdet, zs = 0, 0, []
        for block in self.blocks:
            out, det, log_p, z_new = block(out)
            zs.append(z_new)
            logdet = logdet + det
            log_p_sum = log_p_sum + log_p
        return log_p_sum, logdet - log_q, zs

    @torch.no_grad()
    def reverse(self, zs):
        x = None
        for block, z in zip(reversed(self.blocks), reversed(zs)):
            x = z if x is None else torch.cat([x, z], 1)
            for flow in reversed(block.flows):
                x = flow.reverse(x)
            b, c, h, w = x.shape
            x = x.view(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
        return x + 0.5


def build_flow(name):
    return Glow(GLOW_CFGS[name])


class BitsPerDimLoss(nn.Module):
    def __init__(self, n_bins=256):
        super().__init__()
        self.n_bins = n_bins

    def forward(self, log_p, logdet, image_shape):
        n_pixel = image_shape[1] * image_shape[2] * image_shape[3]
        ll = -math.log(self.n_bins) * n_pixel + logdet + log_p
        bpd = -ll / (math.log(2) * n_pixel)
        return bpd.mean(), (log_p / (math.log(2) * n_pixel)).mean().detach(), (logdet / (math.log(2) * n_pixel)).mean().detach()


def train(model, criterion, loader, optimizer, scaler, args):
    step = 0
    model.train()
    for epoch in range(args.epochs):
        for images, _ in loader:
            images = images.cuda(non_blocking=True)
            if step == 0:
                with torch.no_grad():
                    model(images)  # data-dependent ActNorm initialisation
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                log_p, logdet, _ = model(images)
                loss, lp, ld = criterion(log_p, logdet, images.shape)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            warm = min(1.0, (step + 1) / args.warmup)
            for g in optimizer.param_groups:
                g["lr"] = args.lr * warm
            if step % args.log_every == 0:
                logger.info("ep %d step %d bpd %.4f logp %.4f logdet %.4f scale %.0f", epoch, step, loss.item(),
                            lp.item(), ld.item(), scaler.get_scale())
            if step % args.sample_every == 0:
                save_image(sample(model, args.n_sample, args.temp, args.img_size, args.in_ch),
                           os.path.join(args.out, f"sample_{step:07d}.png"), nrow=8)
            step += 1


@torch.no_grad()
def sample(model, n, temp, img_size, in_ch):
    model.eval()
    zs, ch, size = [], in_ch, img_size
    for i, block in enumerate(model.blocks):
        size //= 2
        last = i == len(model.blocks) - 1
        c = ch * 4 if last else ch * 2
        zs.append(torch.randn(n, c, size, size, device="cuda") * temp)
        ch *= 2
    out = model.reverse(zs).clamp(-0.5, 0.5) + 0.5
    model.train()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar10", choices=list(GLOW_CFGS))
    p.add_argument("--data", default="data/")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--max-grad-norm", type=float, default=50.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--n-sample", type=int, default=64)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--sample-every", type=int, default=5000)
    p.add_argument("--out", default="runs/glow")
    args = p.parse_args()
    cfg = GLOW_CFGS[args.dataset]
    args.img_size, args.in_ch = cfg["img_size"], cfg["in_ch"]
    os.makedirs(args.out, exist_ok=True)

    loader, _ = get_image_loaders(args.dataset, args.data, args.batch_size, img_size=cfg["img_size"])
    model = build_flow(args.dataset).cuda()
    criterion = BitsPerDimLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    train(model, criterion, loader, optimizer, scaler, args)


if __name__ == "__main__":
    main()
