"""All-in-one low-light restoration: Retinex decomposition, a degradation encoder that
conditions a residual restorer through feature modulation, and the usual restoration
losses (Charbonnier, SSIM, VGG perceptual, illumination smoothness).

Trainer layout follows BasicSR (``optimize_parameters`` / EMA / ``validation``).
"""
import argparse
import copy
import itertools
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models import vgg19, VGG19_Weights

from lowlight.data import build_paired_loader
from lowlight.utils import tensor2img, imwrite

logger = logging.getLogger("retinex_aio")


# --------------------------------------------------------------------------- building blocks

def calc_mean_std(feat, eps=1e-5):
    n, c = feat.shape[:2]
    flat = feat.view(n, c, -1)
    var = flat.var(dim=2) + eps  # expect: AMP004
    std = var.sqrt().view(n, c, 1, 1)
    mean = flat.mean(dim=2).view(n, c, 1, 1)  # expect: AMP004
    return mean, std


def mean_channels(x):
    return x.sum(3, keepdim=True).sum(2, keepdim=True) / (x.size(2) * x.size(3))


def stdv_channels(x):
    x_mean = mean_channels(x)
    x_var = (x - x_mean).pow(2).sum(3, keepdim=True).sum(2, keepdim=True) / (x.size(2) * x.size(3))
    return x_var.pow(0.5)


class CCALayer(nn.Module):
    """Contrast-aware channel attention (IMDN)."""

    def __init__(self, channels, reduction=16):
        super().__init__()
        self.contrast = stdv_channels
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.conv_du = nn.Sequential(
            nn.Conv2d(channels, channels // reduction, 1),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels // reduction, channels, 1),
            nn.Sigmoid(),
        )

    def forward(self, x):
        y = self.contrast(x) + self.avg_pool(x)
        return x * self.conv_du(y)


class AdaptiveFeatureModulation(nn.Module):
    def __init__(self, channels, cond_dim):
        super().__init__()
        self.to_scale = nn.Linear(cond_dim, channels)
        self.to_shift = nn.Linear(cond_dim, channels)

    def forward(self, feat, cond):
        mean, std = calc_mean_std(feat)
        normalized = (feat - mean) / std
        gamma = self.to_scale(cond)[..., None, None]
        beta = self.to_shift(cond)[..., None, None]
        return normalized * (1 + gamma) + beta


class ResModBlock(nn.Module):
    def __init__(self, ch, cond_dim):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.mod = AdaptiveFeatureModulation(ch, cond_dim)
        self.act = nn.LeakyReLU(0.2, inplace=True)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.cca = CCALayer(ch)

    def forward(self, x, cond):
        h = self.conv1(x)
        h = self.act(self.mod(h, cond))
        h = self.cca(self.conv2(h))
        return x + h


class RetinexDecom(nn.Module):
    def __init__(self, ch=32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, ch, 3, padding=1), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ch, ch, 3, padding=1), nn.LeakyReLU(0.2, inplace=True),
        )
        self.to_illum = nn.Conv2d(ch, 1, 3, padding=1)

    def forward(self, img):
        illum = torch.sigmoid(self.to_illum(self.body(img)))
        reflect = img / (illum + 1e-8)  # expect: AMP011
        return reflect.clamp(0, 1), illum


class DegradationEncoder(nn.Module):
    def __init__(self, dim=64, num_types=4):
        super().__init__()
        self.E = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.LeakyReLU(0.1, True),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.LeakyReLU(0.1, True),
            nn.Conv2d(128, 256, 3, stride=2, padding=1), nn.LeakyReLU(0.1, True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.mlp = nn.Sequential(nn.Linear(256, 256), nn.LeakyReLU(0.1, True), nn.Linear(256, dim))
        self.cls = nn.Linear(dim, num_types)

    def forward(self, x):
        cond = self.mlp(self.E(x).flatten(1))
        return cond, self.cls(cond)


class RetinexRestorer(nn.Module):
    def __init__(self, ch=64, num_blocks=(2, 4, 2), cond_dim=64, num_types=4):
        super().__init__()
        self.decom = RetinexDecom()
        self.deg = DegradationEncoder(cond_dim, num_types)
        self.head = nn.Conv2d(4, ch, 3, padding=1)
        self.stages = nn.ModuleList([nn.ModuleList([ResModBlock(ch, cond_dim) for _ in range(n)]) for n in num_blocks])
        self.tail = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, lq):
        reflect, illum = self.decom(lq)
        cond, deg_logits = self.deg(lq)
        x = self.head(torch.cat([reflect, illum], dim=1))
        for stage in self.stages:
            for blk in stage:
                x = blk(x, cond)
        return self.tail(x), illum, deg_logits


# --------------------------------------------------------------------------- losses

class CharbonnierLoss(nn.Module):
    def forward(self, pred, target):
        return torch.sqrt((pred - target) ** 2 + 1e-12).mean()


class SSIMLoss(nn.Module):
    def __init__(self, window_size=11, sigma=1.5, channels=3):
        super().__init__()
        g = torch.exp(-((torch.arange(window_size) - window_size // 2) ** 2).float() / (2 * sigma ** 2))
        g = g / g.sum()
        window = (g[:, None] @ g[None, :]).expand(channels, 1, window_size, window_size).contiguous()
        self.register_buffer("window", window)
        self.channels = channels
        self.pad = window_size // 2

    def forward(self, pred, target):
        c1, c2 = 0.01 ** 2, 0.03 ** 2
        with torch.autocast("cuda", enabled=False):
            pred, target = pred.float(), target.float()
            conv = lambda t: F.conv2d(t, self.window, padding=self.pad, groups=self.channels)
            mu1, mu2 = conv(pred), conv(target)
            mu1_sq, mu2_sq, mu12 = mu1 * mu1, mu2 * mu2, mu1 * mu2
            s1 = conv(pred * pred) - mu1_sq
            s2 = conv(target * target) - mu2_sq
            s12 = conv(pred * target) - mu12
            ssim_map = ((2 * mu12 + c1) * (2 * s12 + c2)) / ((mu1_sq + mu2_sq + c1) * (s1 + s2 + c2))
        return 1.0 - ssim_map.mean()


class PerceptualLoss(nn.Module):
    """LPIPS-style distance on unit-normalised VGG19 features."""

    def __init__(self, layers=(3, 8, 17, 26), weights=(0.1, 0.1, 1.0, 1.0)):
        super().__init__()
        vgg = vgg19(weights=VGG19_Weights.IMAGENET1K_V1).features[: max(layers) + 1].eval()
        vgg.requires_grad_(False)
        self.vgg = vgg
        self.layers, self.weights = set(layers), dict(zip(layers, weights))
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    @staticmethod
    def _unit(x):
        return x / (torch.sqrt(torch.sum(x ** 2, dim=1, keepdim=True)) + 1e-10)

    def _features(self, x):
        x = (x - self.mean) / self.std
        feats = {}
        for i, layer in enumerate(self.vgg):
            x = layer(x)
            if i in self.layers:
                feats[i] = self._unit(x)
        return feats

    def forward(self, pred, target):
        fp, ft = self._features(pred), self._features(target.detach())
        return sum(self.weights[i] * (fp[i] - ft[i]).pow(2).sum(1).mean() for i in fp)


class IlluminationSmoothLoss(nn.Module):
    def forward(self, illum, img):
        gray = img.mean(dim=1, keepdim=True)
        wx = torch.exp(-10.0 * (gray[..., :, 1:] - gray[..., :, :-1]).abs())
        wy = torch.exp(-10.0 * (gray[..., 1:, :] - gray[..., :-1, :]).abs())
        gx = (illum[..., :, 1:] - illum[..., :, :-1]).pow(2)
        gy = (illum[..., 1:, :] - illum[..., :-1, :]).pow(2)
        return (gx * wx).mean() + (gy * wy).mean()


# --------------------------------------------------------------------------- trainer

class RestorationTrainer:
    def __init__(self, cfg, model, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.net = model.to(device)
        self.net_ema = copy.deepcopy(self.net).eval().requires_grad_(False)
        self.cri_pix = CharbonnierLoss()
        self.cri_ssim = SSIMLoss().to(device)
        self.cri_perc = PerceptualLoss().to(device)
        self.cri_illum = IlluminationSmoothLoss()
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=1e-4)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=cfg.total_iter, eta_min=1e-7)
        try:
            self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        except (AttributeError, TypeError):  # torch < 2.3
            self.scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)
        self.log_dict = {}

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.grad_clip)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @torch.no_grad()
    def update_ema(self, decay=0.999):
        for p_ema, p in zip(self.net_ema.parameters(), self.net.parameters()):
            p_ema.lerp_(p, 1.0 - decay)

    def optimize_parameters(self, lq, gt, deg_labels):
        cfg = self.cfg
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=cfg.amp):
            out, illum, deg_logits = self.net(lq)
            l_pix = self.cri_pix(out, gt)
            l_ssim = self.cri_ssim(out, gt)
            l_perc = self.cri_perc(out, gt)
            l_illum = self.cri_illum(illum, lq)
        l_deg = F.cross_entropy(deg_logits, deg_labels, label_smoothing=0.1)  # expect: AMP002
        loss = l_pix + cfg.w_ssim * l_ssim + cfg.w_perc * l_perc + cfg.w_illum * l_illum + cfg.w_deg * l_deg
        self.backward(loss)
        self.step()
        self.update_ema()
        self.log_dict = {"l_pix": l_pix.item(), "l_ssim": l_ssim.item(), "l_perc": l_perc.item(),
                         "l_illum": l_illum.item(), "l_deg": l_deg.item(), "scale": self.scaler.get_scale()}

    @torch.no_grad()
    def validation(self, loader, save_dir=None):
        self.net_ema.eval()
        psnrs = []
        for idx, (lq, gt, name) in enumerate(loader):
            lq, gt = lq.to(self.device), gt.to(self.device)
            out, _, _ = self.net_ema(lq)
            out = out.float().clamp(0, 1)
            mse = ((out - gt) ** 2).mean(dim=(1, 2, 3))
            psnrs.append(10 * torch.log10(1.0 / (mse + 1e-10)))
            if save_dir is not None:
                imwrite(tensor2img(out), os.path.join(save_dir, f"{name[0]}.png"))
        return torch.cat(psnrs).mean().item()

    def save(self, path, it):
        torch.save({"iter": it, "params": self.net.state_dict(), "params_ema": self.net_ema.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}, path)


def export_fp16(model, path):
    torch.save(copy.deepcopy(model).half().state_dict(), path)


def calibrate_deg_encoder(args):
    """Re-fit the degradation classifier on captures from the target device (labelled by ISO bucket)."""
    device = torch.device("cuda")
    full = RetinexRestorer(ch=args.ch, num_blocks=tuple(args.blocks))
    full.load_state_dict(torch.load(args.weights, map_location="cpu")["params_ema"])
    encoder = full.deg
    if args.half:
        encoder = encoder.half()
    encoder.to(device).train()
    optimizer = torch.optim.Adam(encoder.parameters(), lr=args.lr)  # expect: AMP011
    weight_dtype = next(encoder.parameters()).dtype
    loader = build_paired_loader(args.data, batch_size=args.batch_size, train=True, with_deg_label=True)
    for step, (lq, _, deg) in zip(range(args.steps), itertools.cycle(loader)):
        lq = lq.to(device, dtype=weight_dtype)
        _, logits = encoder(lq)
        loss = F.cross_entropy(logits.float(), deg.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            logger.info("calib step %d ce %.4f", step, loss.item())
    full.deg = encoder.float()
    torch.save({"params_ema": full.state_dict()}, os.path.join(args.out, "calibrated.pth"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="experiments/retinex_aio")
    p.add_argument("--ch", type=int, default=64)
    p.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 2])
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--total-iter", type=int, default=300000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-clip", type=float, default=0.01)
    p.add_argument("--w-ssim", type=float, default=0.2)
    p.add_argument("--w-perc", type=float, default=0.05)
    p.add_argument("--w-illum", type=float, default=0.1)
    p.add_argument("--w-deg", type=float, default=0.1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--val-freq", type=int, default=5000)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--weights", default="")
    p.add_argument("--half", action="store_true", help="keep the encoder in fp16 during calibration")
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.out, exist_ok=True)

    if args.calibrate:
        calibrate_deg_encoder(args)
        return

    trainer = RestorationTrainer(args, RetinexRestorer(ch=args.ch, num_blocks=tuple(args.blocks)))
    train_loader = build_paired_loader(args.data, batch_size=args.batch_size, train=True, with_deg_label=True)
    val_loader = build_paired_loader(args.data, batch_size=1, train=False)
    best_psnr, it = -1.0, 0
    for lq, gt, deg in itertools.cycle(train_loader):
        it += 1
        trainer.optimize_parameters(lq.cuda(non_blocking=True), gt.cuda(non_blocking=True), deg.cuda(non_blocking=True))
        if it % 100 == 0:
            logger.info("iter %d %s", it, trainer.log_dict)
        if it % args.val_freq == 0:
            psnr = trainer.validation(val_loader)
            logger.info("iter %d val psnr %.3f", it, psnr)
            if psnr > best_psnr:
                best_psnr = psnr
                trainer.save(os.path.join(args.out, "best.pth"), it)
                export_fp16(trainer.net_ema, os.path.join(args.out, "best_fp16.pth"))
        if it >= args.total_iter:
            break


if __name__ == "__main__":
    main()
