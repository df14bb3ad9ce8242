"""DCGAN on a folder of face crops.

Started from the official PyTorch DCGAN tutorial, then added mixed precision,
checkpointing and a few CLI flags so it can run unattended on the lab box.
"""
import argparse
import copy
import os
import random

import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
import torchvision.datasets as dset
import torchvision.transforms as transforms
import torchvision.utils as vutils


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", default="data/celeba")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--nz", type=int, default=100)
    p.add_argument("--ngf", type=int, default=64)
    p.add_argument("--ndf", type=int, default=64)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--clip-d", type=float, default=0.0)
    p.add_argument("--out", default="runs/dcgan")
    p.add_argument("--seed", type=int, default=999)
    return p.parse_args()


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x):
        return self.main(x)


def make_grad_scaler():
    try:
        return torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        # older torch builds on the cluster
        return torch.cuda.amp.GradScaler()


def save_checkpoint(netG, netD, epoch, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"netG": netG.state_dict(), "netD": netD.state_dict(), "epoch": epoch},
               os.path.join(out_dir, "last.pt"))
    # a small copy of the generator for the demo page
    g_small = copy.deepcopy(netG).half()
    torch.save(g_small.state_dict(), os.path.join(out_dir, "generator_fp16.pt"))


def main():
    args = get_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True

    dataset = dset.ImageFolder(
        root=args.dataroot,
        transform=transforms.Compose([
            transforms.Resize(args.image_size),
            transforms.CenterCrop(args.image_size),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]),
    )
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                             num_workers=args.workers, pin_memory=True, drop_last=True)

    netG = Generator(args.nz, args.ngf).to(device)
    netG.apply(weights_init)
    netD = Discriminator(args.ndf).to(device)
    netD.apply(weights_init)

    criterion = nn.BCELoss()
    fixed_noise = torch.randn(64, args.nz, 1, 1, device=device)
    real_label, fake_label = 1.0, 0.0

    optimizerD = optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    scaler = make_grad_scaler()

    iters = 0
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad(set_to_none=True)
            real = data[0].to(device, non_blocking=True)
            b_size = real.size(0)
            label = torch.full((b_size,), real_label, dtype=torch.float, device=device)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                output = netD(real).view(-1)
                errD_real = criterion(output, label)  # expect: AMP003
                noise = torch.randn(b_size, args.nz, 1, 1, device=device)
                fake = netG(noise)
                label.fill_(fake_label)
                output = netD(fake.detach()).view(-1)
                errD_fake = criterion(output, label)  # expect: AMP003
                errD = errD_real + errD_fake
            scaler.scale(errD).backward()
            if args.clip_d > 0:
                torch.nn.utils.clip_grad_norm_(netD.parameters(), args.clip_d)  # expect: AMP005
            scaler.step(optimizerD)

            # (2) Update G: maximize log(D(G(z)))
            netG.zero_grad(set_to_none=True)
            label.fill_(real_label)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                output = netD(fake).view(-1)
                errG = criterion(output, label)  # expect: AMP003
                scaler.scale(errG).backward()  # expect: AMP008
            scaler.step(optimizerG)
            scaler.update()

            if i % 50 == 0:
                print(f"[{epoch}/{args.epochs}][{i}/{len(dataloader)}] "
                      f"Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} "
                      f"scale: {scaler.get_scale():.0f}")

            if iters % 500 == 0 or (epoch == args.epochs - 1 and i == len(dataloader) - 1):
                with torch.no_grad():
                    sample = netG(fixed_noise).detach().cpu()
                os.makedirs(args.out, exist_ok=True)
                vutils.save_image(sample, os.path.join(args.out, f"fake_{iters:06d}.png"),
                                  padding=2, normalize=True)
            iters += 1

        save_checkpoint(netG, netD, epoch, args.out)


if __name__ == "__main__":
    main()
