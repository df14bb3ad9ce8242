"""ESRGAN-style 4x super-resolution training with a VGG perceptual loss.

Usage:
    python train_srgan.py --data /datasets/DIV2K --out runs/esrgan --amp
"""
import argparse
import copy
import logging
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.models import vgg19, VGG19_Weights

from data.sr_dataset import PairedImageDataset
from utils.metrics import calculate_psnr

logger = logging.getLogger("srgan")


class ResidualDenseBlock(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, 1, 1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, 1, 1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf, gc=32):
        super().__init__()
        self.rdb1 = ResidualDenseBlock(nf, gc)
        self.rdb2 = ResidualDenseBlock(nf, gc)
        self.rdb3 = ResidualDenseBlock(nf, gc)

    def forward(self, x):
        out = self.rdb3(self.rdb2(self.rdb1(x)))
        return out * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, in_nc=3, out_nc=3, nf=64, nb=23, gc=32):
        super().__init__()
        self.conv_first = nn.Conv2d(in_nc, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, out_nc, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


class VGGStyleDiscriminator(nn.Module):
    def __init__(self, in_nc=3, nf=64):
        super().__init__()
        layers = []
        c_in = in_nc
        for i, c_out in enumerate([nf, nf * 2, nf * 4, nf * 8, nf * 8]):
            layers += [
                nn.Conv2d(c_in, c_out, 3, 1, 1, bias=False),
                nn.BatchNorm2d(c_out, affine=True),
                nn.LeakyReLU(0.2, inplace=True),
                nn.Conv2d(c_out, c_out, 4, 2, 1, bias=False),
                nn.BatchNorm2d(c_out, affine=True),
                nn.LeakyReLU(0.2, inplace=True),
            ]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.linear1 = nn.Linear(nf * 8, 100)
        self.linear2 = nn.Linear(100, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.pool(self.features(x)).flatten(1)
        return self.linear2(self.lrelu(self.linear1(feat)))


class PerceptualLoss(nn.Module):
    """L1 between VGG19 conv5_4 features (before activation), as in ESRGAN."""

    def __init__(self, layer_idx=34, weight=1.0):
        super().__init__()
        vgg = vgg19(weights=VGG19_Weights.IMAGENET1K_V1).features[:layer_idx + 1]
        vgg.eval()
        for p in vgg.parameters():
            p.requires_grad = False
        self.vgg = vgg
        self.weight = weight
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x, gt):
        x = (x.float() - self.mean) / self.std
        gt = (gt.float() - self.mean) / self.std
        return self.weight * F.l1_loss(self.vgg(x), self.vgg(gt.detach()))


class GANLoss(nn.Module):
    def __init__(self, real_label=1.0, fake_label=0.0):
        super().__init__()
        self.real_label = real_label
        self.fake_label = fake_label
        self.loss = nn.BCEWithLogitsLoss()

    def forward(self, pred, target_is_real):
        target = torch.full_like(pred, self.real_label if target_is_real else self.fake_label)
        return self.loss(pred, target)


def build_models(args, device):
    net_g = RRDBNet(nf=args.nf, nb=args.nb).to(device)
    net_d = VGGStyleDiscriminator().to(device)
    if args.pretrained_psnr:
        state = torch.load(args.pretrained_psnr, map_location="cpu")
        net_g.load_state_dict(state["params_ema"] if "params_ema" in state else state)
        logger.info("loaded PSNR-oriented generator from %s", args.pretrained_psnr)
    return net_g, net_d


@torch.no_grad()
def validate(net_g, loader, device):
    net_g.eval()
    psnrs = []
    for batch in loader:
        lr = batch["lq"].to(device)
        hr = batch["gt"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            sr = net_g(lr)
        sr = sr.float().clamp_(0, 1)
        psnrs.append(calculate_psnr(sr, hr, crop_border=4))
    net_g.train()
    return sum(psnrs) / max(len(psnrs), 1)


def export_generator(net_g, path):
    # fp16 copy for the serving container
    half_g = copy.deepcopy(net_g).half().eval()
    torch.save(half_g.state_dict(), path)


def train(args):
    device = torch.device("cuda")
    net_g, net_d = build_models(args, device)
    cri_pix = nn.L1Loss().to(device)
    cri_percep = PerceptualLoss(weight=args.percep_weight).to(device)
    cri_gan = GANLoss().to(device)

    opt_g = torch.optim.Adam(net_g.parameters(), lr=args.lr_g, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=args.lr_d, betas=(0.9, 0.99))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009

    train_set = PairedImageDataset(args.data, split="train", gt_size=args.gt_size, scale=4)
    val_set = PairedImageDataset(args.data, split="val", scale=4)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, shuffle=False, num_workers=2)

    best_psnr = -1e9
    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        for batch in train_loader:
            lr = batch["lq"].to(device, non_blocking=True)
            hr = batch["gt"].to(device, non_blocking=True)

            # ---- generator ----
            for p in net_d.parameters():
                p.requires_grad = False
            opt_g.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                sr = net_g(lr)
                l_percep = cri_percep(sr, hr)
                real_d_pred = net_d(hr).detach()
                fake_g_pred = net_d(sr)
                l_g_real = cri_gan(real_d_pred - fake_g_pred.mean(), False)  # expect: AMP004
                l_g_fake = cri_gan(fake_g_pred - real_d_pred.float().mean(), True)
                l_g_gan = args.gan_weight * (l_g_real + l_g_fake) / 2
            l_pix = args.pix_weight * cri_pix(sr, hr)  # expect: AMP002
            l_g_total = l_pix + l_percep + l_g_gan
            scaler.scale(l_g_total).backward()
            opt_g.step()  # expect: AMP006

            # ---- discriminator ----
            for p in net_d.parameters():
                p.requires_grad = True
            opt_d.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                fake_d_pred = net_d(sr.detach())
                real_d_pred = net_d(hr)
                l_d_real = cri_gan(real_d_pred - torch.mean(fake_d_pred), True)  # expect: AMP004
                l_d_fake = cri_gan(fake_d_pred - torch.mean(real_d_pred.detach().float()), False)
                l_d = (l_d_real + l_d_fake) / 2
            scaler.scale(l_d).backward()
            torch.nn.utils.clip_grad_norm_(net_d.parameters(), args.clip_d)  # expect: AMP005
            scaler.step(opt_d)
            scaler.update()

            step += 1
            if step % args.log_every == 0:
                logger.info(
                    "ep %d it %d | pix %.4f percep %.4f g_gan %.4f d %.4f | scale %.0f | %.1fs",
                    epoch, step, l_pix.item(), l_percep.item(), l_g_gan.item(), l_d.item(),
                    scaler.get_scale(), time.time() - t0,
                )
                t0 = time.time()

            if step % args.val_every == 0:
                psnr = validate(net_g, val_loader, device)
                logger.info("val psnr %.3f (best %.3f)", psnr, best_psnr)
                if psnr > best_psnr:
                    best_psnr = psnr
                    torch.save({"net_g": net_g.state_dict(), "net_d": net_d.state_dict(),
                                "step": step}, os.path.join(args.out, "best.pth"))

    export_generator(net_g, os.path.join(args.out, "net_g_fp16.pth"))


def finetune_generator_only(net_g, loader, device, args):
    """Short PSNR fine-tune of the generator, used before the GAN stage."""
    opt = torch.optim.Adam(net_g.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    net_g.train()
    for it, batch in enumerate(loader):
        lr = batch["lq"].to(device)
        hr = batch["gt"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            sr = net_g(lr)
            loss = F.l1_loss(sr, hr)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if it >= args.pretrain_iters:
            break
    return net_g


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/esrgan")
    p.add_argument("--nf", type=int, default=64)
    p.add_argument("--nb", type=int, default=23)
    p.add_argument("--gt-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr-g", type=float, default=1e-4)
    p.add_argument("--lr-d", type=float, default=1e-4)
    p.add_argument("--pix-weight", type=float, default=1e-2)
    p.add_argument("--percep-weight", type=float, default=1.0)
    p.add_argument("--gan-weight", type=float, default=5e-3)
    p.add_argument("--clip-d", type=float, default=10.0)
    p.add_argument("--pretrained-psnr", default=None)
    p.add_argument("--pretrain-iters", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--val-every", type=int, default=5000)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    train(args)
