"""RAFT-style optical flow: all-pairs correlation volume + recurrent updates.

Feature and context encoders (and the update block) run under autocast when
``mixed_precision`` is set; the correlation volume and the flow/coordinate
state are kept in fp32, as in the original RAFT.
"""
import argparse
import os
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from flowdata import fetch_dataloader

NORM_LAYERS = {
    "instance": nn.InstanceNorm2d,
    "batch": nn.BatchNorm2d,
    "group": partial(nn.GroupNorm, 8),
    "none": lambda ch: nn.Identity(),
}


def coords_grid(batch, ht, wd, device):
    ys, xs = torch.meshgrid(torch.arange(ht, device=device), torch.arange(wd, device=device), indexing="ij")
    coords = torch.stack([xs, ys], dim=0).float()
    return coords[None].repeat(batch, 1, 1, 1)


def bilinear_sampler(img, coords):
    h, w = img.shape[-2:]
    xgrid, ygrid = coords.split([1, 1], dim=-1)
    xgrid = 2 * xgrid / (w - 1) - 1
    ygrid = 2 * ygrid / (h - 1) - 1
    return F.grid_sample(img, torch.cat([xgrid, ygrid], dim=-1), align_corners=True)


def normalize_fmap(fmap):
    """Zero-mean, unit-variance features per channel before the all-pairs dot product."""
    mu = fmap.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
    sigma = fmap.std(dim=(2, 3), keepdim=True)  # expect: AMP004
    return (fmap - mu) / (sigma + 1e-10)  # expect: AMP011


class ResidualBlock(nn.Module):
    def __init__(self, in_planes, planes, norm_fn="group", stride=1):
        super().__init__()
        norm = NORM_LAYERS[norm_fn]
        self.conv1 = nn.Conv2d(in_planes, planes, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1)
        self.norm1, self.norm2 = norm(planes), norm(planes)
        self.down = None
        if stride != 1 or in_planes != planes:
            self.down = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride), norm(planes))

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        if self.down is not None:
            x = self.down(x)
        return F.relu(x + y)


class BasicEncoder(nn.Module):
    def __init__(self, output_dim=256, norm_fn="instance"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3)
        self.norm1 = NORM_LAYERS[norm_fn](64)
        self.layers = nn.Sequential(
            ResidualBlock(64, 64, norm_fn), ResidualBlock(64, 64, norm_fn),
            ResidualBlock(64, 96, norm_fn, stride=2), ResidualBlock(96, 96, norm_fn),
            ResidualBlock(96, 128, norm_fn, stride=2), ResidualBlock(128, 128, norm_fn),
        )
        self.conv2 = nn.Conv2d(128, output_dim, 1)

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))
        return self.conv2(self.layers(x))


class CorrBlock:
    def __init__(self, fmap1, fmap2, num_levels=4, radius=4):
        self.num_levels, self.radius = num_levels, radius
        b, d, h, w = fmap1.shape
        corr = torch.matmul(fmap1.view(b, d, h * w).transpose(1, 2), fmap2.view(b, d, h * w)) / d ** 0.5
        corr = corr.reshape(b * h * w, 1, h, w)
        self.pyramid = [corr]
        for _ in range(num_levels - 1):
            corr = F.avg_pool2d(corr, 2, stride=2)
            self.pyramid.append(corr)

    def __call__(self, coords):
        r = self.radius
        coords = coords.permute(0, 2, 3, 1)
        b, h, w, _ = coords.shape
        d = torch.linspace(-r, r, 2 * r + 1, device=coords.device)
        delta = torch.stack(torch.meshgrid(d, d, indexing="ij"), dim=-1).view(1, 2 * r + 1, 2 * r + 1, 2)
        out = []
        for i, corr in enumerate(self.pyramid):
            centroid = coords.reshape(b * h * w, 1, 1, 2) / 2 ** i
            out.append(bilinear_sampler(corr, centroid + delta).view(b, h, w, -1))
        return torch.cat(out, dim=-1).permute(0, 3, 1, 2).contiguous().float()


class ConvGRU(nn.Module):
    def __init__(self, hidden_dim=128, input_dim=256):
        super().__init__()
        self.convz = nn.Conv2d(hidden_dim + input_dim, hidden_dim, 3, padding=1)
        self.convr = nn.Conv2d(hidden_dim + input_dim, hidden_dim, 3, padding=1)
        self.convq = nn.Conv2d(hidden_dim + input_dim, hidden_dim, 3, padding=1)

    def forward(self, h, x):
        hx = torch.cat([h, x], dim=1)
        z, r = torch.sigmoid(self.convz(hx)), torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * h, x], dim=1)))
        return (1 - z) * h + z * q


class UpdateBlock(nn.Module):
    def __init__(self, corr_channels, hidden_dim=128, context_dim=128):
        super().__init__()
        self.motion = nn.ModuleDict({
            "corr": nn.Sequential(nn.Conv2d(corr_channels, 192, 1), nn.ReLU(), nn.Conv2d(192, 128, 3, padding=1)),
            "flow": nn.Sequential(nn.Conv2d(2, 64, 7, padding=3), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)),
        })
        self.fuse = nn.Conv2d(128 + 64, 126, 3, padding=1)
        self.gru = ConvGRU(hidden_dim, context_dim + 128)
        self.flow_head = nn.Sequential(nn.Conv2d(hidden_dim, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 2, 3, padding=1))
        self.mask_head = nn.Sequential(nn.Conv2d(hidden_dim, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 64 * 9, 1))

    def forward(self, net, inp, corr, flow):
        cor = F.relu(self.motion["corr"](corr))
        flo = F.relu(self.motion["flow"](flow))
        motion = torch.cat([F.relu(self.fuse(torch.cat([cor, flo], dim=1))), flow], dim=1)
        net = self.gru(net, torch.cat([inp, motion], dim=1))
        return net, 0.25 * self.mask_head(net), self.flow_head(net)


class RAFT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.hidden_dim = self.context_dim = 128
        self.mixed_precision = args.mixed_precision
        self.fnet = BasicEncoder(256, norm_fn="instance")
        self.cnet = BasicEncoder(self.hidden_dim + self.context_dim, norm_fn="batch")
        self.update_block = UpdateBlock(4 * 81, self.hidden_dim, self.context_dim)

    def upsample_flow(self, flow, mask):
        n, _, h, w = flow.shape
        mask = torch.softmax(mask.view(n, 1, 9, 8, 8, h, w), dim=2)
        up = F.unfold(8 * flow, [3, 3], padding=1).view(n, 2, 9, 1, 1, h, w)
        up = torch.sum(mask * up, dim=2).permute(0, 1, 4, 2, 5, 3)
        return up.reshape(n, 2, 8 * h, 8 * w)

    def forward(self, image1, image2, iters=12):
        image1 = 2 * (image1 / 255.0) - 1.0
        image2 = 2 * (image2 / 255.0) - 1.0
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.mixed_precision):
            fmap1 = normalize_fmap(self.fnet(image1))
            fmap2 = normalize_fmap(self.fnet(image2))
            cnet = self.cnet(image1)
            net = torch.tanh(cnet[:, : self.hidden_dim])
            inp = torch.relu(cnet[:, self.hidden_dim :])
        corr_fn = CorrBlock(fmap1.float(), fmap2.float())
        n, _, h, w = fmap1.shape
        coords0 = coords_grid(n, h, w, image1.device)
        coords1 = coords0.clone()
        predictions = []
        for _ in range(iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.mixed_precision):
                net, up_mask, delta_flow = self.update_block(net, inp, corr, coords1 - coords0)
            coords1 = coords1 + delta_flow.float()
            predictions.append(self.upsample_flow(coords1 - coords0, up_mask.float()))
        return predictions


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_flow=400.0):
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    loss = 0.0
    for i, pred in enumerate(flow_preds):
        weight = gamma ** (len(flow_preds) - i - 1)
        loss = loss + weight * (valid[:, None] * (pred - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]
    return loss, {"epe": epe.mean().item(), "1px": (epe < 1).float().mean().item()}


def train(args):
    model = nn.DataParallel(RAFT(args), device_ids=args.gpus)
    model.cuda()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision)
    loader = fetch_dataloader(args)
    total_steps = 0
    while total_steps < args.num_steps:
        for image1, image2, flow, valid in loader:
            optimizer.zero_grad()
            image1, image2, flow, valid = image1.cuda(), image2.cuda(), flow.cuda(), valid.cuda()
            if args.add_noise:
                stdv = np.random.uniform(0.0, 5.0)
                image1 = (image1 + stdv * torch.randn_like(image1)).clamp(0.0, 255.0)
                image2 = (image2 + stdv * torch.randn_like(image2)).clamp(0.0, 255.0)
            flow_predictions = model(image1, image2, iters=args.iters)
            loss, metrics = sequence_loss(flow_predictions, flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)  # expect: AMP006
            scheduler.step()
            total_steps += 1
            if total_steps % args.val_freq == 0:
                os.makedirs("checkpoints", exist_ok=True)
                torch.save(model.state_dict(), f"checkpoints/{total_steps + 1}_{args.name}.pth")
                print(f"step {total_steps} epe {metrics['epe']:.3f}")
            if total_steps >= args.num_steps:
                break
    torch.save(model.state_dict(), f"checkpoints/{args.name}.pth")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft")
    parser.add_argument("--stage", default="chairs")
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=6)
    parser.add_argument("--image_size", type=int, nargs="+", default=[368, 496])
    parser.add_argument("--gpus", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=5e-5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.8)
    parser.add_argument("--add_noise", action="store_true")
    parser.add_argument("--val_freq", type=int, default=5000)
    train(parser.parse_args())
