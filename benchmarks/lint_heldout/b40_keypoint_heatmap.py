"""Top-down human pose estimation: ResNet-style backbone + deconvolution head
(SimpleBaseline), trained with heatmap MSE, an integral (soft-argmax) coordinate branch
with a Laplace likelihood on predicted scales (RLE-lite), and a visibility head.
"""
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class KeypointConfig:
    num_joints: int = 17
    input_size: tuple = (256, 192)
    lr: float = 5e-4
    epochs: int = 140
    clip: float = 10.0
    rle_weight: float = 0.1
    vis_weight: float = 0.05
    spread_weight: float = 0.01


@dataclass
class KeypointOutput:
    heatmaps: torch.Tensor
    coords: torch.Tensor
    sigma: torch.Tensor
    vis_logits: torch.Tensor
    spread: torch.Tensor


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class KeypointBackbone(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), width=64):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        cin = width
        for i, n in enumerate(layers):
            cout = width * 2 ** i
            stage = nn.Sequential()
            for j in range(n):
                stage.add_module(f"block{j}", ResBlock(cin, cout, stride=2 if j == 0 and i > 0 else 1))
                cin = cout
            self.add_module(f"stage{i}", stage)
        self.num_stages = len(layers)
        self.out_channels = cin

    def forward(self, x):
        x = self.stem(x)
        for i in range(self.num_stages):
            x = getattr(self, f"stage{i}")(x)
        return x


class KeypointNet(nn.Module):
    def __init__(self, num_joints=17, beta=20.0):
        super().__init__()
        self.num_joints = num_joints
        self.beta = beta
        self.backbone = KeypointBackbone()
        cin = self.backbone.out_channels
        layers = []
        for _ in range(3):
            layers += [nn.ConvTranspose2d(cin, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            cin = 256
        layers.append(nn.Conv2d(256, num_joints, kernel_size=1))
        self.head = nn.Sequential(*layers)
        self.neck = nn.Conv2d(self.backbone.out_channels, 256, 1)
        self.vis_fc = nn.Linear(256, num_joints)
        self.sigma_fc = nn.Linear(256, num_joints * 2)

    def soft_argmax(self, heatmaps, roi=None):
        b, j, h, w = heatmaps.shape
        logits = heatmaps.flatten(2) * self.beta
        if roi is not None:
            logits = logits.masked_fill(~roi.flatten(2), -1e9)  # expect: AMP007
        prob = logits.softmax(dim=-1).view(b, j, h, w)
        xs = torch.linspace(0.0, 1.0, w, device=heatmaps.device)
        ys = torch.linspace(0.0, 1.0, h, device=heatmaps.device)
        x = (prob.sum(dim=2) * xs).sum(dim=-1)
        y = (prob.sum(dim=3) * ys).sum(dim=-1)
        return torch.stack([x, y], dim=-1)

    def forward(self, images, roi=None):
        feat = self.backbone(images)
        heatmaps = self.head(feat)
        spread = heatmaps.flatten(2).var(dim=-1).mean()  # expect: AMP004
        pooled = self.neck(feat).mean(dim=(2, 3))  # expect: AMP004
        sigma = torch.sigmoid(self.sigma_fc(pooled)).view(-1, self.num_joints, 2)
        return KeypointOutput(
            heatmaps=heatmaps,
            coords=self.soft_argmax(heatmaps, roi),
            sigma=sigma,
            vis_logits=self.vis_fc(pooled),
            spread=spread,
        )


class JointsMSELoss(nn.Module):
    def __init__(self, use_target_weight=True):
        super().__init__()
        self.criterion = nn.MSELoss(reduction="mean")
        self.use_target_weight = use_target_weight

    def forward(self, output, target, target_weight):
        b, j = output.shape[:2]
        pred = output.reshape(b, j, -1).split(1, 1)
        gt = target.reshape(b, j, -1).split(1, 1)
        loss = 0.0
        for idx in range(j):
            hp, hg = pred[idx].squeeze(1), gt[idx].squeeze(1)
            if self.use_target_weight:
                w = target_weight[:, idx]
                loss = loss + 0.5 * self.criterion(hp * w, hg * w)
            else:
                loss = loss + 0.5 * self.criterion(hp, hg)
        return loss / j


def rle_nll(coords, sigma, gt_coords, gt_vis):
    """Laplace negative log-likelihood with predicted per-joint scales."""
    log_sigma = torch.log(sigma + 1e-9)  # expect: AMP011
    resid = (coords - gt_coords).abs() / (math.sqrt(2) * sigma + 1e-9)  # expect: AMP011
    nll = (log_sigma + resid) * gt_vis[..., None]
    return nll.sum() / gt_vis.sum().clamp(min=1.0)


def de_parallel(model):
    return model.module if hasattr(model, "module") else model


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000):
        self.ema = copy.deepcopy(de_parallel(model)).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.updates = 0
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = de_parallel(model).state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def warmup_head(model, loader, cfg, iters=500):
    """Train the heads alone for a few hundred iterations before unfreezing the backbone."""
    model.backbone.requires_grad_(False)
    head_params = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.SGD(head_params, lr=cfg.lr * 10, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    criterion = JointsMSELoss()
    model.train()
    for it, batch in enumerate(loader):
        if it == iters:
            break
        images, target, target_weight = (t.cuda(non_blocking=True) for t in batch[:3])
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
            loss = criterion(out.heatmaps, target, target_weight)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        optimizer.step()  # expect: AMP006
    model.backbone.requires_grad_(True)


def train_epoch(model, loader, optimizer, scaler, ema, cfg, epoch):
    criterion = JointsMSELoss()
    model.train()
    for it, batch in enumerate(loader):
        images, target, target_weight, gt_coords, gt_vis, roi = (t.cuda(non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images, roi)
            loss_hm = criterion(out.heatmaps, target, target_weight)
            loss_rle = rle_nll(out.coords, out.sigma, gt_coords, gt_vis)
            vis_prob = torch.sigmoid(out.vis_logits)
            loss_vis = F.binary_cross_entropy(vis_prob, gt_vis)  # expect: AMP003
            loss = loss_hm + cfg.rle_weight * loss_rle + cfg.vis_weight * loss_vis + cfg.spread_weight * out.spread
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        scaler.step(optimizer)
        scaler.update()
        ema.update(model)
        if it % 100 == 0:
            print(f"epoch {epoch} it {it} hm {loss_hm.item():.5f} rle {loss_rle.item():.3f} scale {scaler.get_scale():.0f}")


@torch.no_grad()
def validate(model, loader):
    model.eval()
    errs = []
    for images, _, _, gt_coords, gt_vis, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images.cuda())
        dist = (out.coords.float() - gt_coords.cuda()).norm(dim=-1)
        errs.append(((dist * gt_vis.cuda()).sum() / gt_vis.sum().clamp(min=1)).item())
    return sum(errs) / max(len(errs), 1)


def synthetic_batches(cfg, n=64, batch=16):
    h, w = cfg.input_size[0] // 4, cfg.input_size[1] // 4
    for _ in range(n):
        gt = torch.rand(batch, cfg.num_joints, 2)
        yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
        d2 = (xx - gt[..., 0, None, None]) ** 2 + (yy - gt[..., 1, None, None]) ** 2
        heat = torch.exp(-d2 / (2 * 0.02 ** 2))
        vis = (torch.rand(batch, cfg.num_joints) > 0.2).float()
        roi = torch.ones(batch, cfg.num_joints, h, w, dtype=torch.bool)
        yield torch.randn(batch, 3, *cfg.input_size), heat, vis[..., None], gt, vis, roi


def main():
    cfg = KeypointConfig()
    model = KeypointNet(cfg.num_joints).cuda()
    warmup_head(model, list(synthetic_batches(cfg)), cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[90, 120], gamma=0.1)
    scaler = torch.amp.GradScaler("cuda")
    ema = ModelEMA(model)
    best = float("inf")
    for epoch in range(cfg.epochs):
        train_epoch(model, synthetic_batches(cfg), optimizer, scaler, ema, cfg, epoch)
        scheduler.step()
        err = validate(ema.ema, synthetic_batches(cfg, n=8))
        if err < best:
            best = err
            torch.save({"model": de_parallel(model).state_dict(), "ema": ema.ema.state_dict()}, "pose_best.pt")


if __name__ == "__main__":
    main()
