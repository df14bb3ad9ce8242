"""RRDB super-resolution with a BasicSR-like ``SRGANModel`` wrapper.

Two-stage recipe:
  1. ``pretrain_psnr`` trains the generator with a Charbonnier loss only;
  2. ``SRGANModel`` fine-tunes it adversarially with pixel, perceptual, feature-statistics
     and total-variation terms, keeps an EMA copy for evaluation and exports fp16 weights.
"""
import copy
import math
import os
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


def charbonnier_loss(pred, target, eps=1e-12):
    return torch.sqrt((pred - target) ** 2 + eps).mean()


class ResidualDenseBlock(nn.Module):
    def __init__(self, num_feat=64, num_grow_ch=32):
        super().__init__()
        self.conv1 = nn.Conv2d(num_feat, num_grow_ch, 3, 1, 1)
        self.conv2 = nn.Conv2d(num_feat + num_grow_ch, num_grow_ch, 3, 1, 1)
        self.conv3 = nn.Conv2d(num_feat + 2 * num_grow_ch, num_grow_ch, 3, 1, 1)
        self.conv4 = nn.Conv2d(num_feat + 3 * num_grow_ch, num_grow_ch, 3, 1, 1)
        self.conv5 = nn.Conv2d(num_feat + 4 * num_grow_ch, num_feat, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, num_feat, num_grow_ch=32):
        super().__init__()
        self.rdb1 = ResidualDenseBlock(num_feat, num_grow_ch)
        self.rdb2 = ResidualDenseBlock(num_feat, num_grow_ch)
        self.rdb3 = ResidualDenseBlock(num_feat, num_grow_ch)

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, num_in_ch=3, num_out_ch=3, num_feat=64, num_block=16, num_grow_ch=32):
        super().__init__()
        self.conv_first = nn.Conv2d(num_in_ch, num_feat, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(num_feat, num_grow_ch) for _ in range(num_block)])
        self.conv_body = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_hr = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_last = nn.Conv2d(num_feat, num_out_ch, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))

    def clip_gradients(self, max_norm, norm_type=2.0):
        """Clip this network's gradients in place; returns the total norm for logging."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type=norm_type)


class VGGStyleDiscriminator(nn.Module):
    def __init__(self, num_in_ch=3, num_feat=64):
        super().__init__()

        def block(cin, cout, stride):
            return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, True)]

        self.features = nn.Sequential(
            nn.Conv2d(num_in_ch, num_feat, 3, 1, 1), nn.LeakyReLU(0.2, True),
            *block(num_feat, num_feat, 2), *block(num_feat, num_feat * 2, 1), *block(num_feat * 2, num_feat * 2, 2),
            *block(num_feat * 2, num_feat * 4, 1), *block(num_feat * 4, num_feat * 4, 2),
            *block(num_feat * 4, num_feat * 8, 1), *block(num_feat * 8, num_feat * 8, 2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(num_feat * 8 * 4 * 4, 100), nn.LeakyReLU(0.2, True), nn.Linear(100, 1), nn.Sigmoid()
        )

    def forward(self, x):
        feat = F.adaptive_avg_pool2d(self.features(x), 4)
        return self.classifier(feat.flatten(1))


class PerceptualNet(nn.Module):
    """Frozen conv feature extractor (the first VGG19 blocks, weights loaded from disk)."""

    def __init__(self, weights=None):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, 1), nn.ReLU(inplace=True), nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(inplace=True), nn.Conv2d(128, 128, 3, 1, 1),
        )
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        if weights is not None:
            self.layers.load_state_dict(torch.load(weights, map_location="cpu"))
        self.requires_grad_(False)

    def forward(self, x):
        return self.layers((x - self.mean) / self.std)


def pretrain_psnr(net_g, loader, total_iters, lr=2e-4, device="cuda"):
    optimizer = torch.optim.Adam(net_g.parameters(), lr=lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_iters, eta_min=1e-7)
    net_g.train()
    it = 0
    while it < total_iters:
        for lq, gt in loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                sr = net_g(lq)
                loss = charbonnier_loss(sr, gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 1000 == 0:
                print(f"[psnr pretrain] iter {it} loss {loss.item():.5f}")
            if it >= total_iters:
                break
    return net_g


class SRGANModel:
    def __init__(self, opt, device="cuda"):
        self.opt = opt
        self.device = device
        self.net_g = RRDBNet(num_block=opt.get("num_block", 16)).to(device)
        self.net_d = VGGStyleDiscriminator().to(device)
        self.net_f = PerceptualNet(opt.get("vgg_weights")).to(device).eval()
        self.net_g_ema = copy.deepcopy(self.net_g).eval().requires_grad_(False)
        self.cri_pix = nn.L1Loss()
        self.cri_gan = nn.BCELoss()
        self.optimizer_g = torch.optim.Adam(self.net_g.parameters(), lr=opt["lr_g"], betas=(0.9, 0.99))
        self.optimizer_d = torch.optim.Adam(self.net_d.parameters(), lr=opt["lr_d"], betas=(0.9, 0.99))
        self.use_amp = opt.get("amp", True)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)
        self.log_dict = OrderedDict()

    def autocast(self):
        return torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.use_amp)

    def optimize_parameters(self, lq, gt, current_iter):
        opt = self.opt
        # ------------------------------------------------------------------ generator
        for p in self.net_d.parameters():
            p.requires_grad = False
        self.optimizer_g.zero_grad(set_to_none=True)
        with self.autocast():
            self.output = self.net_g(lq)
            l_g_pix = opt["pixel_weight"] * self.cri_pix(self.output, gt)
            f_sr, f_gt = self.net_f(self.output), self.net_f(gt)
            l_g_percep = opt["perceptual_weight"] * F.l1_loss(f_sr, f_gt.detach())
            l_g_stats = opt["stats_weight"] * F.l1_loss(f_sr.std(dim=(2, 3)), f_gt.std(dim=(2, 3)))  # expect: AMP004
            dh = self.output[:, :, 1:, :] - self.output[:, :, :-1, :]
            dw = self.output[:, :, :, 1:] - self.output[:, :, :, :-1]
            l_g_tv = opt["tv_weight"] * (dh.abs().mean() + dw.abs().mean())  # expect: AMP004
            fake_g_pred = self.net_d(self.output)
            l_g_gan = opt["gan_weight"] * self.cri_gan(fake_g_pred, torch.ones_like(fake_g_pred))  # expect: AMP003
            l_g_total = l_g_pix + l_g_percep + l_g_stats + l_g_tv + l_g_gan
        self.scaler.scale(l_g_total).backward()
        if opt.get("clip_grad_g"):
            self.log_dict["grad_norm_g"] = self.net_g.clip_gradients(opt["clip_grad_g"]).item()  # expect: AMP005
        self.scaler.step(self.optimizer_g)

        # -------------------------------------------------------------- discriminator
        for p in self.net_d.parameters():
            p.requires_grad = True
        self.optimizer_d.zero_grad(set_to_none=True)
        with self.autocast():
            real_d_pred = self.net_d(gt)
            l_d_real = self.cri_gan(real_d_pred, torch.ones_like(real_d_pred))  # expect: AMP003
            self.scaler.scale(l_d_real).backward()  # expect: AMP008
            fake_d_pred = self.net_d(self.output.detach())
            l_d_fake = self.cri_gan(fake_d_pred, torch.zeros_like(fake_d_pred))  # expect: AMP003
        torch.autograd.backward(self.scaler.scale(l_d_fake))
        self.optimizer_d.step()  # expect: AMP006
        self.scaler.update()

        self.log_dict.update(
            l_g_pix=l_g_pix.item(),
            l_g_percep=l_g_percep.item(),
            l_g_gan=l_g_gan.item(),
            l_d_real=l_d_real.item(),
            l_d_fake=l_d_fake.item(),
            out_d_real=real_d_pred.detach().float().mean().item(),
            out_d_fake=fake_d_pred.detach().float().mean().item(),
        )
        self.model_ema(decay=opt.get("ema_decay", 0.999))

    @torch.no_grad()
    def model_ema(self, decay=0.999):
        net_g_params = dict(self.net_g.named_parameters())
        for k, v in self.net_g_ema.named_parameters():
            v.mul_(decay).add_(net_g_params[k].data, alpha=1 - decay)

    @torch.no_grad()
    def validate(self, loader):
        self.net_g_ema.eval()
        psnrs = []
        for lq, gt in loader:
            lq, gt = lq.to(self.device), gt.to(self.device)
            with self.autocast():
                sr = self.net_g_ema(lq).clamp_(0, 1)
            mse = F.mse_loss(sr.float(), gt).item()
            psnrs.append(10 * math.log10(1.0 / (mse + 1e-10)))
        return sum(psnrs) / max(len(psnrs), 1)

    def save(self, path, current_iter):
        os.makedirs(path, exist_ok=True)
        torch.save(
            {"params": self.net_g.state_dict(), "params_ema": self.net_g_ema.state_dict(), "iter": current_iter},
            os.path.join(path, f"net_g_{current_iter}.pth"),
        )
        torch.save(self.net_d.state_dict(), os.path.join(path, f"net_d_{current_iter}.pth"))

    def export_fp16(self, path):
        net = copy.deepcopy(self.net_g_ema).half()
        torch.save(net.state_dict(), path)
