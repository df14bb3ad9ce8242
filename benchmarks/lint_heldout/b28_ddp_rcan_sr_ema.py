"""Distributed training of RCAN (x4 super-resolution) with contrast-aware channel
attention, gradient accumulation and an EMA of the weights.

    torchrun --nproc_per_node=8 train_rcan_ddp.py --data data/DF2K_sub --scale 4 --amp
"""
import argparse
import copy
import math
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AMP_DTYPE = torch.bfloat16


# --------------------------------------------------------------------------- model
class MeanShift(nn.Conv2d):
    def __init__(self, rgb_range=1.0, rgb_mean=(0.4488, 0.4371, 0.4040), sign=-1):
        super().__init__(3, 3, kernel_size=1)
        self.weight.data = torch.eye(3).view(3, 3, 1, 1)
        self.bias.data = sign * rgb_range * torch.tensor(rgb_mean)
        for p in self.parameters():
            p.requires_grad = False


class CCALayer(nn.Module):
    """Contrast-aware channel attention (IMDN): uses mean + std instead of avg-pool."""

    def __init__(self, channels, reduction=16):
        super().__init__()
        self.conv_du = nn.Sequential(
            nn.Conv2d(channels, channels // reduction, 1),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels // reduction, channels, 1),
            nn.Sigmoid(),
        )

    def forward(self, x):
        mu = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        std = (x - mu).pow(2).mean(dim=(2, 3), keepdim=True).sqrt()
        return x * self.conv_du(std + mu)


class RCAB(nn.Module):
    def __init__(self, n_feat, reduction=16, res_scale=1.0):
        super().__init__()
        self.conv1 = nn.Conv2d(n_feat, n_feat, 3, padding=1)
        self.conv2 = nn.Conv2d(n_feat, n_feat, 3, padding=1)
        self.cca = CCALayer(n_feat, reduction)
        self.res_scale = res_scale

    def forward(self, x):
        res = self.conv2(F.relu(self.conv1(x), inplace=True))
        res = self.cca(res)
        return x + res * self.res_scale


class ResidualGroup(nn.Module):
    def __init__(self, n_feat, n_blocks, reduction=16):
        super().__init__()
        self.blocks = nn.Sequential(*[RCAB(n_feat, reduction) for _ in range(n_blocks)])
        self.conv = nn.Conv2d(n_feat, n_feat, 3, padding=1)

    def forward(self, x):
        return x + self.conv(self.blocks(x))


class RCAN(nn.Module):
    def __init__(self, scale=4, n_groups=10, n_blocks=20, n_feat=64, reduction=16):
        super().__init__()
        self.sub_mean = MeanShift(sign=-1)
        self.add_mean = MeanShift(sign=1)
        self.head = nn.Conv2d(3, n_feat, 3, padding=1)
        self.groups = nn.ModuleList([ResidualGroup(n_feat, n_blocks, reduction) for _ in range(n_groups)])
        self.body_conv = nn.Conv2d(n_feat, n_feat, 3, padding=1)
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(n_feat, 4 * n_feat, 3, padding=1), nn.PixelShuffle(2)]
        self.upsample = nn.Sequential(*up)
        self.tail = nn.Conv2d(n_feat, 3, 3, padding=1)

    def forward(self, x):
        x = self.head(self.sub_mean(x))
        res = x
        for group in self.groups:
            res = group(res)
        res = self.body_conv(res) + x
        return self.add_mean(self.tail(self.upsample(res)))


class ModelEMA:
    def __init__(self, model, decay=0.999):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.module.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1.0 - self.decay)


# --------------------------------------------------------------------------- loss / data
def sobel_kernel(device):
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], device=device)
    return torch.stack([kx, kx.t()]).unsqueeze(1)


def edge_aware_l1_loss(sr, hr, sobel, alpha=2.0):
    gray = 0.299 * sr.detach()[:, 0:1] + 0.587 * sr.detach()[:, 1:2] + 0.114 * sr.detach()[:, 2:3]
    g = F.conv2d(gray, sobel, padding=1).abs().amax(dim=1, keepdim=True)
    w = 1.0 + alpha * g / (g.amax(dim=(2, 3), keepdim=True) + 1e-8)
    return (w.float() * (sr.float() - hr.float()).abs()).mean()


class PairedPatches(Dataset):
    def __init__(self, root, scale=4, patch=48):
        self.lr_dir = os.path.join(root, f"LR_x{scale}")
        self.hr_dir = os.path.join(root, "HR")
        self.names = sorted(os.listdir(self.hr_dir))
        self.scale, self.patch = scale, patch

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        hr = np.load(os.path.join(self.hr_dir, self.names[i]))
        lr = np.load(os.path.join(self.lr_dir, self.names[i]))
        y = np.random.randint(0, lr.shape[0] - self.patch + 1)
        x = np.random.randint(0, lr.shape[1] - self.patch + 1)
        lr = lr[y: y + self.patch, x: x + self.patch]
        s = self.scale
        hr = hr[y * s: (y + self.patch) * s, x * s: (x + self.patch) * s]
        if np.random.rand() < 0.5:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float().div(255.0)
        return to_t(lr), to_t(hr)


# --------------------------------------------------------------------------- train / eval
def train(args, model, ema, loader, sampler, optimizer, scheduler, scaler, sobel, device, rank):
    criterion = nn.L1Loss()
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (lr_img, hr_img) in enumerate(loader):
            lr_img = lr_img.to(device, dtype=AMP_DTYPE, non_blocking=True)  # expect: AMP001
            hr_img = hr_img.to(device, dtype=AMP_DTYPE, non_blocking=True)  # expect: AMP001
            is_step = (it + 1) % args.accum_steps == 0
            sync_ctx = nullcontext() if is_step else model.no_sync()
            with sync_ctx:
                with torch.autocast(device_type="cuda", dtype=AMP_DTYPE, enabled=args.amp):
                    sr = model(lr_img)
                    loss = criterion(sr, hr_img) + args.edge_weight * edge_aware_l1_loss(sr, hr_img, sobel)
                    loss = loss / args.accum_steps
                    if scaler is not None:
                        scaler.scale(loss).backward()  # expect: AMP008
                    else:
                        loss.backward()  # expect: AMP008
            if not is_step:
                continue
            if scaler is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                scaler.step(optimizer)
                scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            ema.update(model.module)
            step += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss.item() * args.accum_steps:.4f} lr {scheduler.get_last_lr()[0]:.2e}")
        if rank == 0 and (epoch + 1) % args.val_every == 0:
            psnr = validate(ema.module, args.val_data, args.scale, device)
            print(f"epoch {epoch}: EMA PSNR {psnr:.3f} dB")
            torch.save({"model": model.module.state_dict(), "ema": ema.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
            torch.save(copy.deepcopy(ema.module).half().state_dict(), os.path.join(args.out, "ema_fp16.pth"))


@torch.no_grad()
def validate(model, val_dir, scale, device, shave=4):
    model.eval()
    scores = []
    for name in sorted(os.listdir(os.path.join(val_dir, "HR"))):
        hr = torch.from_numpy(np.load(os.path.join(val_dir, "HR", name)).transpose(2, 0, 1).copy()).float() / 255.0
        lr = torch.from_numpy(np.load(os.path.join(val_dir, f"LR_x{scale}", name)).transpose(2, 0, 1).copy()).float() / 255.0
        with torch.autocast(device_type="cuda", dtype=AMP_DTYPE):
            sr = model(lr[None].to(device))
        sr = sr.float().clamp(0, 1)[0, :, shave:-shave, shave:-shave]
        hr = hr.to(device)[:, shave:-shave, shave:-shave]
        mse = ((sr - hr) ** 2).mean()
        scores.append(10 * torch.log10(1.0 / (mse + 1e-10)).item())
    return float(np.mean(scores))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/DF2K_sub")
    parser.add_argument("--val-data", default="data/Set5")
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--clip", type=float, default=10.0)
    parser.add_argument("--edge-weight", type=float, default=0.1)
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--out", default="experiments/rcan_x4")
    args = parser.parse_args()

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)
    np.random.seed(1234 + rank)

    dataset = PairedPatches(args.data, args.scale)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    model = RCAN(scale=args.scale).to(device, memory_format=torch.channels_last)
    ema = ModelEMA(model, decay=args.ema_decay)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[200000, 400000, 600000], gamma=0.5)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None  # expect: AMP010
    sobel = sobel_kernel(device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    train(args, model, ema, loader, sampler, optimizer, scheduler, scaler, sobel, device, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
