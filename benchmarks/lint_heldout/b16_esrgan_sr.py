"""ESRGAN (RRDBNet x4) with PSNR-oriented warm-up, then perceptual + relativistic GAN training.

Options follow the BasicSR yaml layout (network_g / network_d / train / val).
"""
import argparse
import math
import os
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torchvision.models import vgg19


# ----------------------------------------------------------------------------- networks
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
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, in_ch=3, out_ch=3, nf=64, nb=23, gc=32):
        super().__init__()
        self.conv_first = nn.Conv2d(in_ch, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, out_ch, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


class VGGStyleDiscriminator(nn.Module):
    def __init__(self, in_ch=3, nf=64, size=128):
        super().__init__()
        layers, ch = [], in_ch
        for i, out in enumerate([nf, nf, nf * 2, nf * 2, nf * 4, nf * 4, nf * 8, nf * 8, nf * 8, nf * 8]):
            stride = 1 if i % 2 == 0 else 2
            layers += [nn.Conv2d(ch, out, 3 if stride == 1 else 4, stride, 1, bias=i == 0)]
            if i > 0:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            ch = out
        self.features = nn.Sequential(*layers)
        self.linear1 = nn.Linear(nf * 8 * (size // 32) ** 2, 100)
        self.linear2 = nn.Linear(100, 1)

    def forward(self, x):
        feat = self.features(x).flatten(1)
        return self.linear2(F.leaky_relu(self.linear1(feat), 0.2))


class PerceptualLoss(nn.Module):
    """L1 between frozen VGG19 conv5_4 features (before activation), as in ESRGAN."""

    def __init__(self, weight=1.0):
        super().__init__()
        vgg = vgg19(weights="IMAGENET1K_V1").features[:35]
        self.vgg = vgg.eval().requires_grad_(False).half()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.weight = weight

    def forward(self, x, gt):
        x_feat = self.vgg((x - self.mean) / self.std)
        gt_feat = self.vgg((gt.detach() - self.mean) / self.std)
        return F.l1_loss(x_feat, gt_feat) * self.weight


class GANLoss(nn.Module):
    def __init__(self, real_label_val=1.0, fake_label_val=0.0, loss_weight=5e-3):
        super().__init__()
        self.loss = nn.BCEWithLogitsLoss()
        self.real_label_val, self.fake_label_val = real_label_val, fake_label_val
        self.loss_weight = loss_weight

    def forward(self, inp, target_is_real, is_disc=False):
        target = inp.new_full(inp.size(), self.real_label_val if target_is_real else self.fake_label_val)
        loss = self.loss(inp, target)
        return loss if is_disc else loss * self.loss_weight


# ----------------------------------------------------------------------------- model wrapper
class ESRGANModel:
    def __init__(self, opt, device):
        self.opt, self.device = opt, device
        self.net_g = RRDBNet(nb=opt["network_g"]["num_block"]).to(device)
        self.net_d = VGGStyleDiscriminator(size=opt["gt_size"]).to(device)
        tr = opt["train"]
        self.cri_pix = nn.L1Loss()
        self.cri_perceptual = PerceptualLoss(tr["perceptual_weight"]).to(device)
        self.cri_gan = GANLoss(loss_weight=tr["gan_weight"])
        self.optimizer_g = torch.optim.Adam(self.net_g.parameters(), lr=tr["lr_g"], betas=(0.9, 0.99))
        self.optimizer_d = torch.optim.Adam(self.net_d.parameters(), lr=tr["lr_d"], betas=(0.9, 0.99))
        self.scaler = torch.amp.GradScaler("cuda", enabled=tr.get("use_amp", True))
        self.log_dict = OrderedDict()

    def feed_data(self, data):
        self.lq = data["lq"].to(self.device, non_blocking=True).half()  # expect: AMP001
        if "gt" in data:
            self.gt = data["gt"].to(self.device, non_blocking=True)

    def optimize_parameters_psnr(self, current_iter):
        self.optimizer_g.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            self.output = self.net_g(self.lq)
            l_pix = self.cri_pix(self.output, self.gt)
        self.scaler.scale(l_pix).backward()
        self.optimizer_g.step()  # expect: AMP006
        self.log_dict["l_pix"] = l_pix.item()

    def optimize_parameters(self, current_iter):
        tr = self.opt["train"]
        for p in self.net_d.parameters():
            p.requires_grad = False
        self.optimizer_g.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            self.output = self.net_g(self.lq)
            l_g_pix = self.cri_pix(self.output, self.gt) * tr["pixel_weight"]
            l_g_percep = self.cri_perceptual(self.output, self.gt)
            real_d_pred = self.net_d(self.gt).detach()
            fake_g_pred = self.net_d(self.output)
            l_g_real = self.cri_gan(real_d_pred - fake_g_pred.mean(0, keepdim=True), False)  # expect: AMP004
            l_g_fake = self.cri_gan(fake_g_pred - real_d_pred.mean(0, keepdim=True), True)  # expect: AMP004
            l_g_total = l_g_pix + l_g_percep + (l_g_real + l_g_fake) / 2
        self.scaler.scale(l_g_total).backward()
        if tr["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.net_g.parameters(), tr["grad_clip"])  # expect: AMP005
        self.scaler.step(self.optimizer_g)

        for p in self.net_d.parameters():
            p.requires_grad = True
        self.optimizer_d.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            fake_d_pred = self.net_d(self.output.detach())
            real_d_pred = self.net_d(self.gt)
            l_d_real = self.cri_gan(real_d_pred - fake_d_pred.detach().float().mean(), True, is_disc=True) * 0.5
            l_d_fake = self.cri_gan(fake_d_pred - real_d_pred.detach().float().mean(), False, is_disc=True) * 0.5
            l_d_total = l_d_real + l_d_fake
        self.scaler.scale(l_d_total).backward()
        self.scaler.unscale_(self.optimizer_d)
        torch.nn.utils.clip_grad_norm_(self.net_d.parameters(), tr["grad_clip_d"])
        self.scaler.step(self.optimizer_d)
        self.scaler.update()

        self.log_dict.update(l_g_pix=l_g_pix.item(), l_g_percep=l_g_percep.item(), l_g_gan=(l_g_real + l_g_fake).item() / 2, l_d=l_d_total.item())

    @torch.no_grad()
    def validation(self, loader):
        self.net_g.eval()
        psnrs = []
        for data in loader:
            self.feed_data(data)
            with torch.autocast("cuda", dtype=torch.float16):
                sr = self.net_g(self.lq)
            sr = sr.float().clamp(0, 1)
            mse = torch.mean((sr - self.gt) ** 2, dim=(1, 2, 3))
            psnrs.append((10 * torch.log10(1.0 / mse.clamp(min=1e-10))).mean().item())
        self.net_g.train()
        return sum(psnrs) / max(len(psnrs), 1)

    def save_network(self, net, path):
        state = {k: v.half().cpu() for k, v in net.state_dict().items()}
        torch.save({"params": state}, path)

    def save(self, current_iter):
        out = self.opt["path"]["models"]
        self.save_network(self.net_g, os.path.join(out, f"net_g_{current_iter}.pth"))
        torch.save({"net_d": self.net_d.state_dict(), "optimizer_g": self.optimizer_g.state_dict(), "optimizer_d": self.optimizer_d.state_dict(), "scaler": self.scaler.state_dict(), "iter": current_iter}, os.path.join(out, f"state_{current_iter}.pth"))


# ----------------------------------------------------------------------------- driver
def train_pipeline(opt, train_loader, val_loader):
    device = torch.device("cuda")
    model = ESRGANModel(opt, device)
    total_iter = opt["train"]["total_iter"]
    psnr_iters = opt["train"]["psnr_warmup_iter"]
    current_iter = 0
    while current_iter < total_iter:
        for data in train_loader:
            current_iter += 1
            model.feed_data(data)
            if current_iter <= psnr_iters:
                model.optimize_parameters_psnr(current_iter)
            else:
                model.optimize_parameters(current_iter)
            if current_iter % opt["logger"]["print_freq"] == 0:
                msg = ", ".join(f"{k}: {v:.4e}" for k, v in model.log_dict.items())
                print(f"[iter {current_iter:8d}] {msg}")
            if current_iter % opt["val"]["val_freq"] == 0:
                print(f"PSNR {model.validation(val_loader):.3f} dB")
            if current_iter % opt["logger"]["save_checkpoint_freq"] == 0:
                model.save(current_iter)
            if current_iter >= total_iter:
                break


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-opt", required=True, help="path to option yaml")
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = yaml.safe_load(f)
    os.makedirs(opt["path"]["models"], exist_ok=True)
    from data import create_loaders  # project-local paired dataset (DIV2K/Flickr2K)

    train_loader, val_loader = create_loaders(opt)
    torch.backends.cudnn.benchmark = True
    train_pipeline(opt, train_loader, val_loader)


if __name__ == "__main__":
    main()
