"""Real-time intermediate flow estimation (IFNet-style) for video frame interpolation.

    torchrun --nproc_per_node 4 b30_frame_interp.py --data /data/vimeo_triplet
"""
import argparse
import copy
import os
from dataclasses import dataclass
from typing import Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from PIL import Image


def warp(img: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    b, _, h, w = flow.shape
    hor = torch.linspace(-1.0, 1.0, w, device=flow.device).view(1, 1, 1, w).expand(b, -1, h, -1)
    ver = torch.linspace(-1.0, 1.0, h, device=flow.device).view(1, 1, h, 1).expand(b, -1, -1, w)
    flow = torch.cat([flow[:, 0:1] / ((w - 1.0) / 2.0), flow[:, 1:2] / ((h - 1.0) / 2.0)], 1)
    grid = (torch.cat([hor, ver], 1) + flow).permute(0, 2, 3, 1)
    return F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=True)


def conv(in_planes, out_planes, kernel_size=3, stride=1, padding=1, dilation=1):
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, dilation=dilation, bias=True),
        nn.PReLU(out_planes),
    )


def deconv(in_planes, out_planes):
    return nn.Sequential(nn.ConvTranspose2d(in_planes, out_planes, 4, 2, 1), nn.PReLU(out_planes))


def instance_stats(x, eps=1e-5):
    mu = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
    var = x.var(dim=(2, 3), keepdim=True, unbiased=False)  # expect: AMP004
    return (x - mu) * torch.rsqrt(var + eps)


class ChannelGate(nn.Module):
    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x):
        w = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(w))))
        return x * w


class IFBlock(nn.Module):
    def __init__(self, in_planes, c=64):
        super().__init__()
        self.conv0 = nn.Sequential(conv(in_planes, c // 2, 3, 2, 1), conv(c // 2, c, 3, 2, 1))
        self.convblock = nn.Sequential(*[conv(c, c) for _ in range(6)])
        self.fuse = nn.Conv2d(c, c, 1)
        self.gate = ChannelGate(c)
        self.lastconv = nn.ConvTranspose2d(c, 5, 4, 2, 1)

    def forward(self, x, flow=None, scale=1.0):
        if scale != 1:
            x = F.interpolate(x, scale_factor=1.0 / scale, mode="bilinear", align_corners=False)
        if flow is not None:
            flow = F.interpolate(flow, scale_factor=1.0 / scale, mode="bilinear", align_corners=False) / scale
            x = torch.cat((x, flow), 1)
        x = self.conv0(x)
        x = self.convblock(x) + x
        x = self.gate(self.fuse(x))
        tmp = self.lastconv(x)
        tmp = F.interpolate(tmp, scale_factor=scale * 2, mode="bilinear", align_corners=False)
        flow = tmp[:, :4] * scale * 2
        mask = tmp[:, 4:5]
        return flow, mask


class ContextNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, 2, 1)
        self.conv2 = nn.Conv2d(c, 2 * c, 3, 2, 1)
        self.conv3 = nn.Conv2d(2 * c, 4 * c, 3, 2, 1)

    def forward(self, img, flow):
        feats = []
        x = F.leaky_relu(instance_stats(self.conv1(img)), 0.2)
        flow = F.interpolate(flow, scale_factor=0.5, mode="bilinear", align_corners=False) * 0.5
        feats.append(warp(x, flow))
        x = F.leaky_relu(instance_stats(self.conv2(x)), 0.2)
        flow = F.interpolate(flow, scale_factor=0.5, mode="bilinear", align_corners=False) * 0.5
        feats.append(warp(x, flow))
        x = F.leaky_relu(instance_stats(self.conv3(x)), 0.2)
        flow = F.interpolate(flow, scale_factor=0.5, mode="bilinear", align_corners=False) * 0.5
        feats.append(warp(x, flow))
        return feats


class RefineUNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.down0 = conv(17, 2 * c, 3, 2, 1)
        self.down1 = conv(4 * c, 4 * c, 3, 2, 1)
        self.down2 = conv(8 * c, 8 * c, 3, 2, 1)
        self.up0 = deconv(16 * c, 4 * c)
        self.up1 = deconv(8 * c, 2 * c)
        self.up2 = deconv(4 * c, c)
        self.out = nn.Conv2d(c, 3, 3, 1, 1)
        self.occ_head = nn.Conv2d(c, 1, 3, 1, 1)

    def forward(self, img0, img1, warped0, warped1, mask, flow, c0, c1):
        s0 = self.down0(torch.cat((img0, img1, warped0, warped1, mask, flow), 1))
        s1 = self.down1(torch.cat((s0, c0[0], c1[0]), 1))
        s2 = self.down2(torch.cat((s1, c0[1], c1[1]), 1))
        x = self.up0(torch.cat((s2, c0[2], c1[2]), 1))
        x = self.up1(torch.cat((x, s1), 1))
        x = self.up2(torch.cat((x, s0), 1))
        res = torch.sigmoid(self.out(x)) * 2 - 1
        occ_log = torch.log(torch.sigmoid(self.occ_head(x)) + 1e-8)  # expect: AMP011
        return res, occ_log


class IFNet(nn.Module):
    def __init__(self, scales=(4, 2, 1), widths=(240, 150, 90), context_width=16):
        super().__init__()
        self.scales = tuple(scales)
        self.blocks = nn.ModuleList(
            [IFBlock(6 if i == 0 else 13 + 4, c=widths[i]) for i in range(len(scales))]
        )
        self.vis_head = nn.Conv2d(7, 2, 3, 1, 1)
        self.context = ContextNet(context_width)
        self.unet = RefineUNet(context_width)

    def forward(self, img0, img1):
        flow, mask = None, None
        warped0, warped1 = img0, img1
        for block, scale in zip(self.blocks, self.scales):
            if flow is None:
                flow, mask = block(torch.cat((img0, img1), 1), None, scale=scale)
            else:
                f_d, m_d = block(torch.cat((img0, img1, warped0, warped1, mask), 1), flow, scale=scale)
                flow = flow + f_d
                mask = mask + m_d
            warped0 = warp(img0, flow[:, :2])
            warped1 = warp(img1, flow[:, 2:4])
        vis = torch.sigmoid(self.vis_head(torch.cat((warped0, warped1, mask), 1)))
        weight0 = vis[:, 0:1]
        weight1 = vis[:, 1:2]
        merged = (weight0 * warped0 + weight1 * warped1) / (weight0 + weight1 + 1e-10)  # expect: AMP011
        c0 = self.context(img0, flow[:, :2])
        c1 = self.context(img1, flow[:, 2:4])
        res, occ_log = self.unet(img0, img1, warped0, warped1, torch.sigmoid(mask), flow, c0, c1)
        pred = torch.clamp(merged + res, 0, 1)
        return {"pred": pred, "merged": merged, "flow": flow, "occ_log": occ_log}


class LapLoss(nn.Module):
    def __init__(self, max_levels=5, channels=3):
        super().__init__()
        self.max_levels = max_levels
        k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
        self.register_buffer("kernel", (torch.outer(k, k) / 256.0).expand(channels, 1, 5, 5).contiguous())

    def pyramid(self, img):
        current = img
        pyr = []
        for _ in range(self.max_levels):
            filtered = F.conv2d(F.pad(current, (2, 2, 2, 2), mode="reflect"), self.kernel, groups=current.shape[1])
            down = filtered[:, :, ::2, ::2]
            up = F.interpolate(down, size=current.shape[-2:], mode="bilinear", align_corners=False)
            pyr.append(current - up)
            current = down
        return pyr

    def forward(self, pred, target):
        return sum(F.l1_loss(a, b) for a, b in zip(self.pyramid(pred), self.pyramid(target)))


class TernaryLoss(nn.Module):
    def __init__(self, patch_size=7):
        super().__init__()
        out_channels = patch_size * patch_size
        w = torch.eye(out_channels).reshape(patch_size, patch_size, 1, out_channels)
        self.register_buffer("w", w.permute(3, 2, 0, 1).contiguous())
        self.patch_size = patch_size

    def transform(self, img):
        gray = 0.299 * img[:, 0:1] + 0.587 * img[:, 1:2] + 0.114 * img[:, 2:3]
        patches = F.conv2d(gray, self.w, padding=self.patch_size // 2)
        loc_diff = patches - gray
        return loc_diff / torch.sqrt(0.81 + loc_diff ** 2)

    def forward(self, pred, target):
        t0, t1 = self.transform(pred), self.transform(target)
        dist_sq = (t0 - t1) ** 2
        dist_norm = (dist_sq / (0.1 + dist_sq)).mean(1, keepdim=True)
        pad = self.patch_size // 2
        return dist_norm[:, :, pad:-pad, pad:-pad].mean()


@dataclass
class TrainConfig:
    data: str = "/data/vimeo_triplet"
    out_dir: str = "checkpoints/ifnet"
    epochs: int = 300
    batch_size: int = 16
    lr: float = 3e-4
    weight_decay: float = 1e-4
    accum_steps: int = 2
    max_norm: float = 1.0
    scales: Tuple[int, ...] = (4, 2, 1)
    widths: Tuple[int, ...] = (240, 150, 90)
    workers: int = 8


def build_model(cfg: TrainConfig) -> nn.Module:
    return IFNet(scales=cfg.scales, widths=cfg.widths)


class VimeoTriplet(torch.utils.data.Dataset):
    def __init__(self, root, split="train"):
        with open(os.path.join(root, f"tri_{split}list.txt")) as f:
            self.items = [line.strip() for line in f if line.strip()]
        self.root, self.split = root, split

    def __len__(self):
        return len(self.items)

    def _load(self, name, idx):
        img = np.asarray(Image.open(os.path.join(self.root, "sequences", name, f"im{idx}.png")).convert("RGB"))
        return torch.from_numpy(img.copy()).permute(2, 0, 1).float() / 255.0

    def __getitem__(self, i):
        name = self.items[i]
        img0, gt, img1 = self._load(name, 1), self._load(name, 2), self._load(name, 3)
        flow = torch.from_numpy(np.load(os.path.join(self.root, "flow", name, "flow_t.npy")))
        if self.split == "train" and np.random.rand() < 0.5:
            img0, img1 = img1, img0
            flow = torch.cat([flow[2:4], flow[0:2]], 0)
        return img0, gt, img1, flow


def build_loader(cfg, split, distributed):
    dataset = VimeoTriplet(cfg.data, split=split)
    sampler = DistributedSampler(dataset, shuffle=(split == "train")) if distributed else None
    return DataLoader(dataset, batch_size=cfg.batch_size, shuffle=(sampler is None and split == "train"),
                      sampler=sampler, num_workers=cfg.workers, pin_memory=True, drop_last=(split == "train"))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    psnrs = []
    for img0, gt, img1, _ in loader:
        img0, gt, img1 = img0.to(device), gt.to(device), img1.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(img0, img1)["pred"]
        mse = ((pred.float() - gt) ** 2).mean(dim=(1, 2, 3))
        psnrs.append(-10.0 * torch.log10(mse))
    model.train()
    return torch.cat(psnrs).mean().item()


def export_onnx(model, path, height=256, width=448):
    net = copy.deepcopy(model).half().eval().cuda()
    dummy = torch.randn(1, 3, height, width, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        torch.onnx.export(net, (dummy, dummy), path, opset_version=17,
                          input_names=["img0", "img1"], output_names=["pred"])


def train(cfg: TrainConfig):
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if distributed:
        dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    is_main = local_rank == 0

    model = build_model(cfg).to(device)
    if distributed:
        model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler("cuda")
    lap = LapLoss().to(device)
    census = TernaryLoss().to(device)

    train_loader, val_loader = build_loader(cfg, "train", distributed), build_loader(cfg, "test", False)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.epochs * len(train_loader) // cfg.accum_steps)
    step, best_psnr = 0, 0.0
    for epoch in range(cfg.epochs):
        if distributed:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        for i, (img0, gt, img1, flow_gt) in enumerate(train_loader):
            img0, gt, img1, flow_gt = (t.to(device, non_blocking=True) for t in (img0, gt, img1, flow_gt))
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img0, img1)
                loss_rec = lap(out["pred"], gt) + 0.1 * census(out["pred"], gt)
                loss_occ = (-out["occ_log"]).mean()
            loss_flow = F.smooth_l1_loss(out["flow"], flow_gt)  # expect: AMP002
            loss = (loss_rec + 0.01 * loss_flow + 1e-3 * loss_occ) / cfg.accum_steps
            scaler.scale(loss).backward()
            if (i + 1) % cfg.accum_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
                if is_main and step % 100 == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
        if is_main:
            raw = model.module if distributed else model
            psnr = validate(raw, val_loader, device)
            print(f"epoch {epoch}: val psnr {psnr:.3f}")
            if psnr > best_psnr:
                best_psnr = psnr
                os.makedirs(cfg.out_dir, exist_ok=True)
                torch.save(raw.state_dict(), os.path.join(cfg.out_dir, "best.pth"))
    if distributed:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=TrainConfig.data)
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--export", default=None)
    args = parser.parse_args()
    cfg = TrainConfig(data=args.data, epochs=args.epochs)
    if args.export:
        model = build_model(cfg)
        model.load_state_dict(torch.load(os.path.join(cfg.out_dir, "best.pth"), map_location="cpu"))
        export_onnx(model, args.export)
        return
    train(cfg)


if __name__ == "__main__":
    main()
