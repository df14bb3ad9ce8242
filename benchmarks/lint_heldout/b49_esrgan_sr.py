"""ESRGAN-style x4 super-resolution: RRDB generator with IMDN channel attention."""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def mean_channels(feat):
    spatial_sum = feat.sum(3, keepdim=True).sum(2, keepdim=True)
    return spatial_sum / (feat.size(2) * feat.size(3))


def stdv_channels(feat):
    feat_mean = mean_channels(feat)
    feat_var = (feat - feat_mean).pow(2).sum(3, keepdim=True).sum(2, keepdim=True)
    return (feat_var / (feat.size(2) * feat.size(3))).pow(0.5)


class CCALayer(nn.Module):
    def __init__(self, channel, reduction=16):
        super().__init__()
        self.conv_du = nn.Sequential(
            nn.Conv2d(channel, channel // reduction, 1, padding=0, bias=True),
            nn.ReLU(inplace=True),
            nn.Conv2d(channel // reduction, channel, 1, padding=0, bias=True),
            nn.Sigmoid(),
        )

    def forward(self, x):
        y = stdv_channels(x) + mean_channels(x)
        return x * self.conv_du(y)


class ResidualDenseBlock(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, 1, 1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, 1, 1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def _spatial_stats(self, feat):
        mu = feat.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        sd = feat.std(dim=(2, 3), keepdim=True)  # expect: AMP004
        return mu, sd

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        mu, sd = self._spatial_stats(x5)
        x5 = (x5 - mu) / (sd + 1e-8)  # expect: AMP011
        return x5 * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf, gc=32):
        super().__init__()
        self.rdb1 = ResidualDenseBlock(nf, gc)
        self.rdb2 = ResidualDenseBlock(nf, gc)
        self.rdb3 = ResidualDenseBlock(nf, gc)
        self.cca = CCALayer(nf)

    def forward(self, x):
        out = self.rdb3(self.rdb2(self.rdb1(x)))
        return self.cca(out) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, in_nc=3, out_nc=3, nf=64, nb=8, gc=32):
        super().__init__()
        self.conv_first = nn.Conv2d(in_nc, nf, 3, 1, 1)
        self.body = nn.ModuleList([RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, out_nc, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        body = feat
        for block in self.body:
            body = block(body)
        feat = feat + self.conv_body(body)
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


class VGGStyleDiscriminator(nn.Module):
    def __init__(self, in_nc=3, nf=64, size=128):
        super().__init__()
        layers, c = [], in_nc
        for i, width in enumerate([nf, nf * 2, nf * 4, nf * 8, nf * 8]):
            layers += [nn.Conv2d(c, width, 3, 1, 1), nn.LeakyReLU(0.2, True),
                       nn.Conv2d(width, width, 4, 2, 1), nn.LeakyReLU(0.2, True)]
            c = width
        self.features = nn.Sequential(*layers)
        spatial = size // 32
        self.linear1 = nn.Linear(nf * 8 * spatial * spatial, 100)
        self.linear2 = nn.Linear(100, 1)

    def forward(self, x):
        feat = self.features(x).flatten(1)
        return self.linear2(F.leaky_relu(self.linear1(feat), 0.2))


def build_models(args):
    net_g = RRDBNet(nf=args.nf, nb=8)
    net_d = VGGStyleDiscriminator(size=args.gt_size)
    return net_g, net_d


@torch.no_grad()
def validate(net_g, loader, device):
    net_g.eval()
    psnrs = []
    for lr_img, hr_img in loader:
        sr = net_g(lr_img.to(device)).clamp(0, 1)
        mse = (sr - hr_img.to(device)).pow(2).mean(dim=(1, 2, 3))
        psnrs.append((10 * torch.log10(1.0 / (mse + 1e-10))).mean().item())
    net_g.train()
    return sum(psnrs) / max(len(psnrs), 1)


def export_half(net_g, path):
    torch.save(copy.deepcopy(net_g).half().state_dict(), path)


def train(args, train_loader, val_loader):
    device = torch.device("cuda")
    net_g, net_d = build_models(args)
    net_g.to(device)
    net_d.to(device)
    opt_g = torch.optim.Adam(net_g.parameters(), lr=args.lr, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scaler = torch.amp.GradScaler("cuda")
    best_psnr = -1e9
    for epoch in range(100):
        for lr_img, hr_img in train_loader:
            lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
            for p in net_d.parameters():
                p.requires_grad_(False)
            with torch.autocast("cuda", dtype=torch.float16):
                sr = net_g(lr_img)
                l_pix = F.l1_loss(sr, hr_img)
                d_real = net_d(hr_img).detach()
                d_fake = net_d(sr)
                real_rel = d_real - d_fake.mean(0, keepdim=True)  # expect: AMP004
                fake_rel = d_fake - d_real.mean(0, keepdim=True)  # expect: AMP004
                l_adv = (F.binary_cross_entropy_with_logits(real_rel, torch.zeros_like(real_rel))
                         + F.binary_cross_entropy_with_logits(fake_rel, torch.ones_like(fake_rel))) / 2
                loss_g = args.pix_weight * l_pix + args.adv_weight * l_adv
            opt_g.zero_grad(set_to_none=True)
            scaler.scale(loss_g).backward()
            torch.nn.utils.clip_grad_norm_(net_g.parameters(), args.clip_norm)  # expect: AMP005
            scaler.step(opt_g)

            for p in net_d.parameters():
                p.requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.float16):
                d_real = net_d(hr_img)
                d_fake = net_d(sr.detach())
                fake_mean = torch.mean(d_fake.float(), 0, keepdim=True)
                real_mean = torch.mean(d_real.float(), 0, keepdim=True)
                l_d = (F.binary_cross_entropy_with_logits(d_real - fake_mean, torch.ones_like(d_real))
                       + F.binary_cross_entropy_with_logits(d_fake - real_mean, torch.zeros_like(d_fake))) / 2
            opt_d.zero_grad(set_to_none=True)
            scaler.scale(l_d).backward()
            scaler.unscale_(opt_d)
            torch.nn.utils.clip_grad_norm_(net_d.parameters(), args.clip_norm)
            scaler.step(opt_d)
            scaler.update()
        psnr = validate(net_g, val_loader, device)
        if psnr > best_psnr:
            best_psnr = psnr
            export_half(net_g, os.path.join(args.out_dir, "net_g_best_fp16.pth"))
    return best_psnr


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nf", type=int, default=64)
    parser.add_argument("--gt-size", dest="gt_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--pix-weight", dest="pix_weight", type=float, default=1e-2)
    parser.add_argument("--adv-weight", dest="adv_weight", type=float, default=5e-3)
    parser.add_argument("--clip-norm", dest="clip_norm", type=float, default=10.0)
    parser.add_argument("--out-dir", dest="out_dir", default="experiments/esrgan")
    return parser.parse_args()
