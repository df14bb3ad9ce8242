"""Face landmark regression (WFLW, 98 points).

ConvNeXt-style backbone, FPN-lite neck with contrast-aware channel attention,
heatmap head with soft-argmax, uncertainty-aware coordinate head and an optional
point-token refiner. Trained with Wing loss (Feng et al., CVPR 2018).
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class LayerNorm2d(nn.Module):
    """LayerNorm over the channel dimension of NCHW tensors."""

    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class Block(nn.Module):
    def __init__(self, dim, layer_scale=1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim)
        self.pwconv1 = nn.Conv2d(dim, 4 * dim, 1)
        self.pwconv2 = nn.Conv2d(4 * dim, dim, 1)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim, 1, 1))

    def forward(self, x):
        shortcut = x
        x = self.norm(self.dwconv(x))
        x = self.pwconv2(F.gelu(self.pwconv1(x)))
        return shortcut + self.gamma * x


class Backbone(nn.Module):
    def __init__(self, dims=(64, 128, 256), depths=(2, 2, 6)):
        super().__init__()
        self.downsample = nn.ModuleList([nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0]))])
        for i in range(1, len(dims)):
            self.downsample.append(nn.Sequential(nn.Conv2d(dims[i - 1], dims[i], 2, 2), LayerNorm2d(dims[i])))
        self.stages = nn.ModuleList([nn.Sequential(*[Block(d) for _ in range(n)]) for d, n in zip(dims, depths)])

    def forward(self, x):
        feats = []
        for down, stage in zip(self.downsample, self.stages):
            x = stage(down(x))
            feats.append(x)
        return feats


def mean_channels(t):
    spatial_sum = t.sum(3, keepdim=True).sum(2, keepdim=True)
    return spatial_sum / (t.size(2) * t.size(3))


def stdv_channels(t):
    t_mean = mean_channels(t)
    t_variance = (t - t_mean).pow(2).sum(3, keepdim=True).sum(2, keepdim=True) / (t.size(2) * t.size(3))
    return t_variance.pow(0.5)


class CCALayer(nn.Module):
    def __init__(self, channel, reduction=16):
        super().__init__()
        self.contrast = stdv_channels
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.conv_du = nn.Sequential(
            nn.Conv2d(channel, channel // reduction, 1), nn.ReLU(inplace=True),
            nn.Conv2d(channel // reduction, channel, 1), nn.Sigmoid(),
        )

    def forward(self, x):
        y = self.contrast(x) + self.avg_pool(x)
        return x * self.conv_du(y)


class Neck(nn.Module):
    def __init__(self, in_dims, out_dim=128):
        super().__init__()
        self.lateral = nn.ModuleList([nn.Conv2d(d, out_dim, 1) for d in in_dims])
        self.smooth = nn.Conv2d(out_dim, out_dim, 3, padding=1)
        self.cca = CCALayer(out_dim)

    def forward(self, feats):
        x = self.lateral[-1](feats[-1])
        for i in range(len(feats) - 2, -1, -1):
            x = F.interpolate(x, size=feats[i].shape[-2:], mode="bilinear", align_corners=False)
            x = x + self.lateral[i](feats[i])
        return self.cca(self.smooth(x))


class AttentionPool(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.att = nn.Conv2d(dim, 1, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        v = self.proj(x)
        w = torch.sigmoid(self.att(x))
        return (v * w).mean(dim=(2, 3))  # expect: AMP004


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), (x.size(-2), x.size(-1))).pow(1.0 / self.p)


def soft_argmax(heatmaps):
    b, k, h, w = heatmaps.shape
    flat = heatmaps.flatten(2)
    flat = flat - flat.amax(dim=-1, keepdim=True)
    prob = F.softmax(flat, dim=-1).view(b, k, h, w)
    xs = torch.linspace(-1.0, 1.0, w, device=heatmaps.device, dtype=prob.dtype)
    ys = torch.linspace(-1.0, 1.0, h, device=heatmaps.device, dtype=prob.dtype)
    x = (prob.sum(2) * xs).sum(-1)
    y = (prob.sum(3) * ys).sum(-1)
    return torch.stack([x, y], dim=-1)


class TokenNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # expect: AMP004
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class LandmarkRefiner(nn.Module):
    def __init__(self, in_ch, dim=128, heads=4):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.token_proj = nn.Linear(in_ch, dim)
        self.norm = TokenNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.offset = nn.Linear(dim, 2)

    def forward(self, feat, coords, visible=None):
        tokens = F.grid_sample(feat, coords.unsqueeze(2), align_corners=False).squeeze(-1).transpose(1, 2)
        t = self.token_proj(tokens)
        b, k, d = t.shape
        q, kk, v = self.qkv(self.norm(t)).view(b, k, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ kk.transpose(-2, -1)) * self.scale
        if visible is not None:
            attn = attn.masked_fill(~visible[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        t = t + self.out((attn @ v).transpose(1, 2).reshape(b, k, d))
        return coords + 0.1 * torch.tanh(self.offset(t))


class LandmarkNet(nn.Module):
    def __init__(self, num_points=98, dims=(64, 128, 256), depths=(2, 2, 6), refine=False):
        super().__init__()
        self.num_points = num_points
        self.backbone = Backbone(dims, depths)
        self.neck = Neck(dims, 128)
        self.heat_head = nn.Sequential(
            nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(128, num_points, 1)
        )
        self.pool = AttentionPool(128)
        self.coord_fc = nn.Linear(128, num_points * 2)
        self.scale_head = nn.Linear(128, num_points * 2)
        self.vis_pool = GeM()
        self.vis_fc = nn.Linear(128, num_points)
        self.refiner = LandmarkRefiner(128) if refine else None

    def forward(self, images):
        x = self.neck(self.backbone(images))
        heatmaps = self.heat_head(x)
        pooled = self.pool(x)
        coords = soft_argmax(heatmaps) + 0.1 * torch.tanh(self.coord_fc(pooled)).view(-1, self.num_points, 2)
        scale = self.scale_head(pooled).abs() + 1e-9  # expect: AMP011
        vis_logits = self.vis_fc(self.vis_pool(x).flatten(1))
        out = {"heatmaps": heatmaps, "coords": coords, "scale": scale.view(-1, self.num_points, 2),
               "vis_logits": vis_logits}
        if self.refiner is not None:
            out["refined"] = self.refiner(x, coords.detach(), vis_logits.detach() > 0)
        else:
            out["refined"] = coords
        return out


class WingLoss(nn.Module):
    def __init__(self, w=10.0, epsilon=2.0):
        super().__init__()
        self.w = w
        self.epsilon = epsilon
        self.C = w - w * math.log(1 + w / epsilon)

    def forward(self, pred, target):
        x = (target - pred).abs()
        loss = torch.where(x < self.w, self.w * torch.log(1 + x / self.epsilon), x - self.C)
        return loss.sum(dim=(1, 2)).mean()


def laplace_nll(mu, scale, target):
    return (torch.log(2 * scale) + (mu - target).abs() / scale).mean()


MODEL_REGISTRY = {
    "lmk_s": lambda cfg: LandmarkNet(cfg.num_points, dims=(48, 96, 192), depths=(2, 2, 4)),
    "lmk_b": lambda cfg: LandmarkNet(cfg.num_points),
    "lmk_b_refine": lambda cfg: LandmarkNet(cfg.num_points, refine=True),
}


def train_one_epoch(model, loader, optimizer, scaler, criterion, device, cfg, epoch):
    model.train()
    half_size = cfg.img_size / 2.0
    for it, batch in enumerate(loader):
        images = batch["image"].to(device, non_blocking=True).half()  # expect: AMP001
        target = batch["landmarks"].to(device, non_blocking=True)
        heat_t = batch["heatmaps"].to(device, non_blocking=True)
        vis_t = batch["visible"].to(device, non_blocking=True).float()
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            out = model(images)
            loss_heat = F.mse_loss(out["heatmaps"], heat_t)
            loss_nll = laplace_nll(out["coords"], out["scale"], target)
            with torch.autocast("cuda", enabled=False):
                loss_vis = F.binary_cross_entropy(torch.sigmoid(out["vis_logits"].float()), vis_t)
        loss_wing = criterion(out["refined"] * half_size, target * half_size)  # expect: AMP002
        loss = cfg.w_heat * loss_heat + cfg.w_nll * loss_nll + cfg.w_vis * loss_vis + loss_wing
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        scaler.step(optimizer)
        scaler.update()
        if it % cfg.log_every == 0:
            print(f"[{epoch}:{it}] wing {loss_wing.item():.4f} heat {loss_heat.item():.5f} "
                  f"nll {loss_nll.item():.4f} gn {grad_norm.item():.2f}")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    nmes = []
    for batch in loader:
        images = batch["image"].to(device)
        target = batch["landmarks"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(images)["refined"]
        inter_ocular = (target[:, 60] - target[:, 72]).norm(dim=-1)
        nme = (pred.float() - target).norm(dim=-1).mean(-1) / inter_ocular
        nmes.append(nme.cpu())
    model.train()
    nmes = torch.cat(nmes).numpy()
    return float(nmes.mean()), float((nmes > 0.1).mean())


class WFLWCache(torch.utils.data.Dataset):
    """Pre-cropped WFLW faces stored as uint8 arrays with landmarks in [-1, 1]."""

    def __init__(self, root, split, img_size, heat_size=64, sigma=0.03):
        data = np.load(os.path.join(root, f"{split}_{img_size}.npz"))
        self.images, self.landmarks, self.visible = data["images"], data["landmarks"], data["visible"]
        self.grid = torch.linspace(-1.0, 1.0, heat_size)
        self.sigma = sigma

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = torch.from_numpy(self.images[i]).permute(2, 0, 1).float() / 255.0
        lmk = torch.from_numpy(self.landmarks[i]).float()
        gx = torch.exp(-((self.grid[None, :] - lmk[:, 0:1]) ** 2) / (2 * self.sigma ** 2))
        gy = torch.exp(-((self.grid[None, :] - lmk[:, 1:2]) ** 2) / (2 * self.sigma ** 2))
        heat = gy[:, :, None] * gx[:, None, :]
        return {"image": img, "landmarks": lmk, "heatmaps": heat,
                "visible": torch.from_numpy(self.visible[i])}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/wflw")
    p.add_argument("--arch", default="lmk_b", choices=sorted(MODEL_REGISTRY))
    p.add_argument("--num-points", type=int, default=98)
    p.add_argument("--img-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--w-heat", type=float, default=100.0)
    p.add_argument("--w-nll", type=float, default=0.1)
    p.add_argument("--w-vis", type=float, default=0.5)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", default="work_dirs/wflw")
    return p.parse_args()


def main():
    args = parse_args()
    device = torch.device("cuda")
    train_loader = DataLoader(WFLWCache(args.data, "train", args.img_size), batch_size=args.batch_size,
                              shuffle=True, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(WFLWCache(args.data, "test", args.img_size), batch_size=args.batch_size, num_workers=4)
    model = MODEL_REGISTRY[args.arch](args).to(device)
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    criterion = WingLoss()
    best_nme = 1e9
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scaler, criterion, device, args, epoch)
        scheduler.step()
        nme, fr = evaluate(model, val_loader, device)
        print(f"epoch {epoch}: NME {nme * 100:.2f}% FR@0.1 {fr * 100:.2f}%")
        if nme < best_nme:
            best_nme = nme
            torch.save({"model": model.state_dict(), "epoch": epoch, "nme": nme},
                       os.path.join(args.out, "best.pth"))


if __name__ == "__main__":
    main()
