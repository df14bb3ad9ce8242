import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import datasets  # RAFT core/datasets.py: FlyingChairs, FlyingThings3D, Sintel, KITTI

MAX_FLOW = 400


class ResidualBlock(nn.Module):
    def __init__(self, in_planes, planes, norm_fn="instance", stride=1):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(in_planes, planes, 3, padding=1, stride=stride), nn.Conv2d(planes, planes, 3, padding=1)
        norm = nn.InstanceNorm2d if norm_fn == "instance" else nn.BatchNorm2d
        self.norm1, self.norm2 = norm(planes), norm(planes)
        self.downsample = None if stride == 1 else nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride), norm(planes))

    def forward(self, x):
        y = F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))
        return F.relu((x if self.downsample is None else self.downsample(x)) + y)


class BasicEncoder(nn.Module):
    def __init__(self, output_dim=128, norm_fn="batch"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3)
        self.norm1 = nn.InstanceNorm2d(64) if norm_fn == "instance" else nn.BatchNorm2d(64)
        self.layers = nn.Sequential(ResidualBlock(64, 64, norm_fn, 1), ResidualBlock(64, 96, norm_fn, 2), ResidualBlock(96, 128, norm_fn, 2))
        self.conv2 = nn.Conv2d(128, output_dim, kernel_size=1)

    def forward(self, x):
        is_list = isinstance(x, (tuple, list))
        if is_list:
            batch_dim = x[0].shape[0]
            x = torch.cat(x, dim=0)
        x = self.conv2(self.layers(F.relu(self.norm1(self.conv1(x)))))
        if is_list:
            x = torch.split(x, [batch_dim, batch_dim], dim=0)
        return x


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
    def __init__(self, corr_planes, hidden_dim=128):
        super().__init__()
        self.convc, self.convf = nn.Conv2d(corr_planes, 96, 1), nn.Conv2d(2, 32, 7, padding=3)
        self.gru = ConvGRU(hidden_dim, input_dim=128 + 96 + 32)
        self.flow_head = nn.Sequential(nn.Conv2d(hidden_dim, 256, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(256, 2, 3, padding=1))
        self.mask = nn.Sequential(nn.Conv2d(hidden_dim, 256, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(256, 64 * 9, 1))

    def forward(self, net, inp, corr, flow):
        motion = torch.cat([F.relu(self.convc(corr)), F.relu(self.convf(flow))], dim=1)
        net = self.gru(net, torch.cat([inp, motion], dim=1))
        return net, 0.25 * self.mask(net), self.flow_head(net)


def coords_grid(batch, ht, wd, device):
    coords = torch.meshgrid(torch.arange(ht, device=device), torch.arange(wd, device=device), indexing="ij")
    return torch.stack(coords[::-1], dim=0).float()[None].repeat(batch, 1, 1, 1)


def bilinear_sampler(img, coords):
    H, W = img.shape[-2:]
    xgrid, ygrid = coords.split([1, 1], dim=-1)
    grid = torch.cat([2 * xgrid / (W - 1) - 1, 2 * ygrid / (H - 1) - 1], dim=-1)
    return F.grid_sample(img, grid, align_corners=True)


class CorrBlock:
    def __init__(self, fmap1, fmap2, num_levels=4, radius=4):
        self.radius = radius
        batch, dim, ht, wd = fmap1.shape
        corr = torch.matmul(fmap1.view(batch, dim, ht * wd).transpose(1, 2), fmap2.view(batch, dim, ht * wd))
        corr = corr.reshape(batch * ht * wd, 1, ht, wd) / dim ** 0.5
        self.corr_pyramid = [corr]
        for _ in range(num_levels - 1):
            corr = F.avg_pool2d(corr, 2, stride=2)
            self.corr_pyramid.append(corr)

    def __call__(self, coords):
        r = self.radius
        coords = coords.permute(0, 2, 3, 1)
        batch, h1, w1, _ = coords.shape
        d = torch.linspace(-r, r, 2 * r + 1, device=coords.device)
        delta = torch.stack(torch.meshgrid(d, d, indexing="ij"), dim=-1).view(1, 2 * r + 1, 2 * r + 1, 2)
        out = []
        for i, corr in enumerate(self.corr_pyramid):
            coords_lvl = coords.reshape(batch * h1 * w1, 1, 1, 2) / 2 ** i + delta
            out.append(bilinear_sampler(corr, coords_lvl).view(batch, h1, w1, -1))
        return torch.cat(out, dim=-1).permute(0, 3, 1, 2).contiguous().float()


def _standardize(feat):
    """Zero-mean / unit-variance features per pixel: better conditioned all-pairs correlation."""
    mu = feat.mean(dim=1, keepdim=True)  # expect: AMP004
    sigma = feat.std(dim=1, keepdim=True)  # expect: AMP004
    return (feat - mu) / (sigma + 1e-8)  # expect: AMP011


class RAFT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.hdim = self.cdim = 128
        self.fnet = BasicEncoder(output_dim=256, norm_fn="instance")
        self.cnet = BasicEncoder(output_dim=self.hdim + self.cdim, norm_fn="batch")
        self.update_block = UpdateBlock(4 * (2 * 4 + 1) ** 2, hidden_dim=self.hdim)

    def freeze_bn(self):
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()

    def upsample_flow(self, flow, mask):
        N, _, H, W = flow.shape
        mask = torch.softmax(mask.view(N, 1, 9, 8, 8, H, W), dim=2)
        up_flow = F.unfold(8 * flow, [3, 3], padding=1).view(N, 2, 9, 1, 1, H, W)
        up_flow = torch.sum(mask * up_flow, dim=2).permute(0, 1, 4, 2, 5, 3)
        return up_flow.reshape(N, 2, 8 * H, 8 * W)

    def forward(self, image1, image2, iters=12):
        image1, image2 = 2 * (image1 / 255.0) - 1.0, 2 * (image2 / 255.0) - 1.0
        with torch.autocast("cuda", enabled=self.args.mixed_precision):
            fmap1, fmap2 = self.fnet([image1, image2])
            fmap1, fmap2 = _standardize(fmap1), _standardize(fmap2)
        corr_fn = CorrBlock(fmap1.float(), fmap2.float(), radius=4)
        with torch.autocast("cuda", enabled=self.args.mixed_precision):
            net, inp = torch.split(self.cnet(image1), [self.hdim, self.cdim], dim=1)
            net, inp = torch.tanh(net), torch.relu(inp)
        N, _, H, W = image1.shape
        coords0 = coords_grid(N, H // 8, W // 8, image1.device)
        coords1 = coords_grid(N, H // 8, W // 8, image1.device)
        flow_predictions = []
        for _ in range(iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            flow = coords1 - coords0
            with torch.autocast("cuda", enabled=self.args.mixed_precision):
                net, up_mask, delta_flow = self.update_block(net, inp, corr, flow)
            coords1 = coords1 + delta_flow.float()
            flow_up = self.upsample_flow(coords1 - coords0, up_mask)
            flow_predictions.append(flow_up)
        return flow_predictions


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_flow=MAX_FLOW):
    n_predictions = len(flow_preds)
    flow_loss = 0.0
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        flow_loss += i_weight * (valid[:, None] * (flow_preds[i] - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt().view(-1)[valid.view(-1)]
    metrics = {"epe": epe.mean().item(), "1px": (epe < 1).float().mean().item(), "5px": (epe < 5).float().mean().item()}
    return flow_loss, metrics


def fetch_optimizer(args, model):
    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=args.epsilon)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05, cycle_momentum=False, anneal_strategy="linear")
    return optimizer, scheduler


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


def optimizer_step(model, optimizer, scheduler, scaler, clip):
    """Clip, step and advance the one-cycle schedule (shared by all stages)."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # expect: AMP005
    scaler.step(optimizer)
    scheduler.step()
    scaler.update()


def train(args):
    model = nn.DataParallel(RAFT(args), device_ids=args.gpus).cuda().train()
    if args.stage != "chairs":
        model.module.freeze_bn()
    train_loader = datasets.fetch_dataloader(args)
    optimizer, scheduler = fetch_optimizer(args, model)
    scaler = make_grad_scaler(args.mixed_precision)
    total_steps = 0
    while total_steps <= args.num_steps:
        for data_blob in train_loader:
            optimizer.zero_grad()
            image1, image2, flow, valid = [x.cuda() for x in data_blob]
            flow_predictions = model(image1, image2, iters=args.iters)
            loss, metrics = sequence_loss(flow_predictions, flow, valid, args.gamma)
            scaler.scale(loss).backward()
            optimizer_step(model, optimizer, scheduler, scaler, args.clip)
            total_steps += 1
            if total_steps % 100 == 0:
                print(f"[{total_steps:6d}] " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
            if total_steps % 5000 == 0:
                torch.save(model.state_dict(), f"checkpoints/{total_steps}_{args.name}.pth")
            if total_steps > args.num_steps:
                break
    torch.save(model.state_dict(), f"checkpoints/{args.name}.pth")
    return model


def finetune_kitti(args, model):
    """Short KITTI fine-tune stage; fp32 unless --mixed_precision."""
    model.module.freeze_bn()
    loader = datasets.fetch_dataloader(args)
    optimizer, scheduler = fetch_optimizer(args, model)
    scaler = torch.amp.GradScaler("cuda") if args.mixed_precision else None
    for step, data_blob in enumerate(loader):
        image1, image2, flow, valid = [x.cuda() for x in data_blob]
        optimizer.zero_grad(set_to_none=True)
        loss, metrics = sequence_loss(model(image1, image2, iters=args.iters), flow, valid, args.gamma)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()  # expect: AMP006
        scheduler.step()
        if step >= args.num_steps:
            break
    return model


def benchmark(args, n=20):
    """python train.py --benchmark: time a training step at the stage resolution."""
    model = RAFT(args).cuda().train()
    optimizer = optim.AdamW(model.parameters(), lr=1e-4)
    image1 = torch.randint(0, 255, (args.batch_size, 3, *args.image_size), device="cuda").float()
    image2 = torch.randint_like(image1, 0, 255)
    flow_gt = torch.randn(args.batch_size, 2, *args.image_size, device="cuda")
    valid = torch.ones(args.batch_size, *args.image_size, device="cuda")
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.time()
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            loss, _ = sequence_loss(model(image1, image2, iters=args.iters), flow_gt, valid, args.gamma)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.time() - t0)
    print(f"{np.median(times[5:]) * 1000:.1f} ms / step")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft")
    parser.add_argument("--stage", default="chairs", choices=["chairs", "things", "sintel", "kitti"])
    parser.add_argument("--lr", type=float, default=0.00002)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=6)
    parser.add_argument("--image_size", type=int, nargs="+", default=[384, 512])
    parser.add_argument("--gpus", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--mixed_precision", action="store_true", help="use mixed precision")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=0.00005)
    parser.add_argument("--epsilon", type=float, default=1e-8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.8, help="exponential weighting")
    parser.add_argument("--benchmark", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(1234)
    np.random.seed(1234)
    os.makedirs("checkpoints", exist_ok=True)
    if args.benchmark:
        benchmark(args)
    elif args.stage == "kitti":
        finetune_kitti(args, train(args))
    else:
        train(args)
