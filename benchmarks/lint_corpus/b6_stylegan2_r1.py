"""StyleGAN2-lite: modulated generator with skip ToRGB outputs, residual discriminator with
minibatch-stddev, lazy R1 and path-length regularisation, G EMA. One GradScaler per network,
so that the generator's overflows do not shrink the discriminator's loss scale.

    python train_stylegan2_lite.py /data/ffhq64 --size 64 --batch 32 --iter 200000
"""
import argparse
import copy
import math
import os
import random

import torch
import torch.nn.functional as F
from torch import autograd, nn, optim
from torch.utils import data
from torchvision import datasets, transforms, utils


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-8)


class MappingNetwork(nn.Module):
    def __init__(self, z_dim, w_dim, n_layers=8):
        super().__init__()
        layers = [PixelNorm()]
        for i in range(n_layers):
            layers += [nn.Linear(z_dim if i == 0 else w_dim, w_dim), nn.LeakyReLU(0.2)]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(z)


class ModulatedConv2d(nn.Module):
    def __init__(self, in_ch, out_ch, kernel, w_dim, demodulate=True, upsample=False):
        super().__init__()
        self.in_ch, self.out_ch, self.k, self.pad = in_ch, out_ch, kernel, kernel // 2
        self.demodulate, self.upsample = demodulate, upsample
        self.scale = 1 / math.sqrt(in_ch * kernel ** 2)
        self.weight = nn.Parameter(torch.randn(1, out_ch, in_ch, kernel, kernel))
        self.modulation = nn.Linear(w_dim, in_ch)
        nn.init.ones_(self.modulation.bias)

    def forward(self, x, w):
        b, c, h, wd = x.shape
        style = self.modulation(w).view(b, 1, c, 1, 1)
        weight = self.scale * self.weight * style
        if self.demodulate:
            demod = torch.rsqrt(weight.pow(2).sum([2, 3, 4]) + 1e-8)
            weight = weight * demod.view(b, self.out_ch, 1, 1, 1)
        weight = weight.view(b * self.out_ch, c, self.k, self.k)
        if self.upsample:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        out = F.conv2d(x.reshape(1, b * c, x.shape[2], x.shape[3]), weight, padding=self.pad, groups=b)
        return out.view(b, self.out_ch, out.shape[2], out.shape[3])


class StyledConv(nn.Module):
    def __init__(self, in_ch, out_ch, w_dim, upsample=False):
        super().__init__()
        self.conv = ModulatedConv2d(in_ch, out_ch, 3, w_dim, upsample=upsample)
        self.noise_strength = nn.Parameter(torch.zeros(1))
        self.bias = nn.Parameter(torch.zeros(1, out_ch, 1, 1))

    def forward(self, x, w):
        out = self.conv(x, w)
        noise = torch.randn(out.shape[0], 1, out.shape[2], out.shape[3], device=out.device, dtype=out.dtype)
        return F.leaky_relu(out + self.noise_strength * noise + self.bias, 0.2) * math.sqrt(2)


class ToRGB(nn.Module):
    def __init__(self, in_ch, w_dim):
        super().__init__()
        self.conv = ModulatedConv2d(in_ch, 3, 1, w_dim, demodulate=False)
        self.bias = nn.Parameter(torch.zeros(1, 3, 1, 1))

    def forward(self, x, w, skip=None):
        out = self.conv(x, w) + self.bias
        if skip is not None:
            out = out + F.interpolate(skip, scale_factor=2, mode="bilinear", align_corners=False)
        return out


class Generator(nn.Module):
    def __init__(self, size, z_dim=512, w_dim=512, ch=256):
        super().__init__()
        self.z_dim = z_dim
        self.log_size = int(math.log2(size))
        self.n_latent = self.log_size * 2 - 2
        self.mapping = MappingNetwork(z_dim, w_dim)
        self.const = nn.Parameter(torch.randn(1, ch, 4, 4))
        self.conv1 = StyledConv(ch, ch, w_dim)
        self.to_rgb1 = ToRGB(ch, w_dim)
        self.convs, self.to_rgbs = nn.ModuleList(), nn.ModuleList()
        for _ in range(3, self.log_size + 1):
            self.convs.append(StyledConv(ch, ch, w_dim, upsample=True))
            self.convs.append(StyledConv(ch, ch, w_dim))
            self.to_rgbs.append(ToRGB(ch, w_dim))

    def forward(self, styles, return_latents=False):
        ws = [self.mapping(s) for s in styles]
        if len(ws) < 2:
            latent = ws[0].unsqueeze(1).repeat(1, self.n_latent, 1)
        else:
            cut = random.randint(1, self.n_latent - 1)
            latent = torch.cat([ws[0].unsqueeze(1).repeat(1, cut, 1), ws[1].unsqueeze(1).repeat(1, self.n_latent - cut, 1)], 1)
        out = self.const.repeat(latent.shape[0], 1, 1, 1)
        out = self.conv1(out, latent[:, 0])
        skip = self.to_rgb1(out, latent[:, 1])
        i = 1
        for conv_up, conv, to_rgb in zip(self.convs[::2], self.convs[1::2], self.to_rgbs):
            out = conv_up(out, latent[:, i])
            out = conv(out, latent[:, i + 1])
            skip = to_rgb(out, latent[:, i + 2], skip)
            i += 2
        return (skip, latent) if return_latents else (skip, None)


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, in_ch, 3, padding=1)
        self.conv2 = nn.Conv2d(in_ch, out_ch, 3, padding=1, stride=2)
        self.skip = nn.Conv2d(in_ch, out_ch, 1, stride=2, bias=False)

    def forward(self, x):
        out = F.leaky_relu(self.conv1(x), 0.2)
        out = F.leaky_relu(self.conv2(out), 0.2)
        return (out + self.skip(x)) / math.sqrt(2)


class MinibatchStdDev(nn.Module):
    def __init__(self, group_size=4, num_features=1):
        super().__init__()
        self.group_size, self.num_features = group_size, num_features

    def forward(self, x):
        b, c, h, w = x.shape
        g, f = min(self.group_size, b), self.num_features
        y = x.view(g, -1, f, c // f, h, w)
        y = torch.sqrt(y.var(0, unbiased=False) + 1e-8)  # expect: AMP004 AMP011
        y = y.mean([2, 3, 4], keepdim=True).squeeze(2)  # expect: AMP004
        y = y.repeat(g, 1, h, w)
        return torch.cat([x, y], dim=1)


class Discriminator(nn.Module):
    def __init__(self, size, ch=256):
        super().__init__()
        self.from_rgb = nn.Conv2d(3, ch, 1)
        self.blocks = nn.Sequential(*[ResBlock(ch, ch) for _ in range(int(math.log2(size)) - 2)])
        self.mbstd = MinibatchStdDev()
        self.final_conv = nn.Conv2d(ch + 1, ch, 3, padding=1)
        self.final_linear = nn.Sequential(nn.Linear(ch * 4 * 4, ch), nn.LeakyReLU(0.2), nn.Linear(ch, 1))

    def forward(self, img):
        out = F.leaky_relu(self.from_rgb(img), 0.2)
        out = self.blocks(out)
        out = self.mbstd(out)
        out = F.leaky_relu(self.final_conv(out), 0.2)
        return self.final_linear(out.flatten(1))


def make_scaler(init_scale=2.0 ** 14):
    try:
        return torch.amp.GradScaler("cuda", init_scale=init_scale)
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler(init_scale=init_scale)


def d_r1_loss(real_pred, real_img):
    grad_real, = autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()


def g_path_regularize(fake_img, latents, mean_path_length, decay=0.01):
    noise = torch.randn_like(fake_img) / math.sqrt(fake_img.shape[2] * fake_img.shape[3])
    grad, = autograd.grad(outputs=(fake_img * noise).sum(), inputs=latents, create_graph=True)
    path_lengths = torch.sqrt(grad.pow(2).sum(2).mean(1))
    path_mean = mean_path_length + decay * (path_lengths.mean() - mean_path_length)
    path_penalty = (path_lengths - path_mean).pow(2).mean()
    return path_penalty, path_mean.detach(), path_lengths


def mixing_noise(batch, latent_dim, prob, device):
    if prob > 0 and random.random() < prob:
        return list(torch.randn(2, batch, latent_dim, device=device).unbind(0))
    return [torch.randn(batch, latent_dim, device=device)]


def accumulate(model1, model2, decay=0.999):
    par1, par2 = dict(model1.named_parameters()), dict(model2.named_parameters())
    for k in par1.keys():
        par1[k].data.mul_(decay).add_(par2[k].data, alpha=1 - decay)


def export_generator(g_ema, path):
    torch.save(copy.deepcopy(g_ema).half().state_dict(), path)


def train(args, loader, generator, discriminator, g_ema, device):
    g_reg_ratio = args.g_reg_every / (args.g_reg_every + 1)
    d_reg_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_optim = optim.Adam(generator.parameters(), lr=args.lr * g_reg_ratio, betas=(0, 0.99 ** g_reg_ratio))
    d_optim = optim.Adam(discriminator.parameters(), lr=args.lr * d_reg_ratio, betas=(0, 0.99 ** d_reg_ratio))
    g_scaler, d_scaler = make_scaler(), make_scaler()
    adv_criterion = nn.BCELoss()

    mean_path_length = torch.tensor(0.0, device=device)
    sample_z = torch.randn(args.n_sample, args.latent, device=device)
    loader = iter(loader)
    for i in range(args.start_iter, args.iter):
        real_img = next(loader, (None,))[0]
        if real_img is None:
            break
        real_img = real_img.to(device)
        # ---- discriminator ----
        noise = mixing_noise(args.batch, args.latent, args.mixing, device)
        with torch.autocast("cuda", dtype=torch.float16):
            fake_img, _ = generator(noise)
            fake_pred = discriminator(fake_img.detach())
            real_pred = discriminator(real_img)
            # BCE on probabilities, written out so the two terms can be logged separately
            d_real, d_fake = torch.sigmoid(real_pred), torch.sigmoid(fake_pred)
            d_loss = -(torch.log(d_real + 1e-8) + torch.log(1 - d_fake + 1e-8)).mean()  # expect: AMP011
        discriminator.zero_grad(set_to_none=True)
        d_scaler.scale(d_loss).backward()
        d_scaler.step(d_optim)
        d_scaler.update()

        if i % args.d_reg_every == 0:
            real_img.requires_grad = True
            with torch.autocast("cuda", dtype=torch.float16):
                real_pred = discriminator(real_img)
                r1_loss = d_r1_loss(real_pred, real_img)
                discriminator.zero_grad(set_to_none=True)
                d_scaler.scale(args.r1 / 2 * r1_loss * args.d_reg_every + 0 * real_pred[0]).backward()  # expect: AMP008
            d_optim.step()  # expect: AMP006

        # ---- generator ----
        noise = mixing_noise(args.batch, args.latent, args.mixing, device)
        with torch.autocast("cuda", dtype=torch.float16):
            fake_img, _ = generator(noise)
            fake_pred = discriminator(fake_img)
            g_loss = adv_criterion(torch.sigmoid(fake_pred), torch.ones_like(fake_pred))  # expect: AMP003
        generator.zero_grad(set_to_none=True)
        g_scaler.scale(g_loss).backward()
        g_optim.step()  # expect: AMP006

        if i % args.g_reg_every == 0:
            path_batch_size = max(1, args.batch // args.path_batch_shrink)
            noise = mixing_noise(path_batch_size, args.latent, args.mixing, device)
            with torch.autocast("cuda", dtype=torch.float16):
                fake_img, latents = generator(noise, return_latents=True)
                path_loss, mean_path_length, path_lengths = g_path_regularize(fake_img, latents, mean_path_length)
                weighted_path_loss = args.path_regularize * args.g_reg_every * path_loss
                if args.path_batch_shrink:
                    weighted_path_loss = weighted_path_loss + 0 * fake_img[0, 0, 0, 0]
            generator.zero_grad(set_to_none=True)
            g_scaler.scale(weighted_path_loss).backward()
            g_scaler.step(g_optim)
            g_scaler.update()

        accumulate(g_ema, generator, 0.5 ** (32 / (10 * 1000)))
        if i % 100 == 0:
            print(f"[{i}] d {d_loss.item():.4f} g {g_loss.item():.4f} path {mean_path_length.item():.4f} d_scale {d_scaler.get_scale():.0f} g_scale {g_scaler.get_scale():.0f}")
        if i % 2000 == 0:
            with torch.no_grad():
                g_ema.eval()
                sample, _ = g_ema([sample_z])
                utils.save_image(sample, os.path.join(args.out, f"sample/{i:06d}.png"), nrow=int(args.n_sample ** 0.5), normalize=True, value_range=(-1, 1))
        if i % 10000 == 0:
            torch.save({"g": generator.state_dict(), "d": discriminator.state_dict(), "g_ema": g_ema.state_dict(), "g_optim": g_optim.state_dict(), "d_optim": d_optim.state_dict(), "g_scaler": g_scaler.state_dict(), "d_scaler": d_scaler.state_dict(), "args": args}, os.path.join(args.out, f"checkpoint/{i:06d}.pt"))
    export_generator(g_ema, os.path.join(args.out, "g_ema_fp16.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=str)
    defaults = dict(out="runs/stylegan2-lite", iter=200000, start_iter=0, batch=32, n_sample=64, size=64, latent=512,
                    r1=10.0, path_regularize=2.0, path_batch_shrink=2, d_reg_every=16, g_reg_every=4, mixing=0.9, lr=0.002)
    for name, value in defaults.items():
        parser.add_argument(f"--{name}", type=type(value), default=value)
    args = parser.parse_args()

    device = "cuda"
    for sub in ("sample", "checkpoint"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    generator = Generator(args.size, args.latent, args.latent).to(device)
    discriminator = Discriminator(args.size).to(device)
    g_ema = copy.deepcopy(generator).eval()
    accumulate(g_ema, generator, 0)
    transform = transforms.Compose([transforms.Resize(args.size), transforms.CenterCrop(args.size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), inplace=True)])
    dataset = datasets.ImageFolder(args.path, transform=transform)
    loader = data.DataLoader(dataset, batch_size=args.batch, sampler=data.RandomSampler(dataset, replacement=True, num_samples=args.iter * args.batch), drop_last=True, num_workers=4)
    train(args, loader, generator, discriminator, g_ema, device)
