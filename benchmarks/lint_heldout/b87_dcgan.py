"""DCGAN on an image folder (CelebA, LSUN bedrooms, ...) at 64x64."""
import argparse
import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torchvision.datasets as dset
import torchvision.transforms as transforms
import torchvision.utils as vutils


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, nz=100, ngf=64, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf=64, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
        )

    def forward(self, x):
        return self.main(x).view(-1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--nz", type=int, default=100)
    p.add_argument("--niter", type=int, default=25)
    p.add_argument("--lr", type=float, default=0.0002)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--outf", default="dcgan_out")
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args()


def main():
    opt = get_args()
    seed = opt.seed if opt.seed is not None else random.randint(1, 10000)
    random.seed(seed)
    torch.manual_seed(seed)
    os.makedirs(opt.outf, exist_ok=True)

    dataset = dset.ImageFolder(
        root=opt.dataroot,
        transform=transforms.Compose([
            transforms.Resize(opt.image_size), transforms.CenterCrop(opt.image_size),
            transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]),
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=opt.batch_size, shuffle=True,
                                         num_workers=opt.workers, drop_last=True, pin_memory=True)
    device = torch.device("cuda:0")
    use_amp = opt.amp

    netG = Generator(opt.nz).to(device)
    netG.apply(weights_init)
    netD = Discriminator().to(device)
    netD.apply(weights_init)

    adv_criterion = nn.BCEWithLogitsLoss()
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    fixed_noise = torch.randn(64, opt.nz, 1, 1, device=device)

    for epoch in range(opt.niter):
        for i, (real, _) in enumerate(loader):
            real = real.to(device, non_blocking=True)
            b = real.size(0)
            real_labels = torch.ones(b, device=device)
            fake_labels = torch.zeros(b, device=device)

            # (1) discriminator: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad(set_to_none=True)
            noise = torch.randn(b, opt.nz, 1, 1, device=device)
            with torch.cuda.amp.autocast(enabled=use_amp):  # expect: AMP009
                out_real = netD(real)
                errD_real = F.binary_cross_entropy(torch.sigmoid(out_real), real_labels)  # expect: AMP003
                fake = netG(noise)
                out_fake = netD(fake.detach())
                errD_fake = F.binary_cross_entropy(torch.sigmoid(out_fake), fake_labels)  # expect: AMP003
                errD = errD_real + errD_fake
                scaler.scale(errD).backward()  # expect: AMP008
            scaler.step(optimizerD)

            # (2) generator: maximize log(D(G(z)))
            netG.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
                out_gen = netD(fake)
                errG = adv_criterion(out_gen, real_labels)
            scaler.scale(errG).backward()
            optimizerG.step()  # expect: AMP006
            scaler.update()

            if i % 50 == 0:
                D_x = torch.sigmoid(out_real.detach().float()).mean().item()
                D_G_z = torch.sigmoid(out_gen.detach().float()).mean().item()
                print(f"[{epoch}/{opt.niter}][{i}/{len(loader)}] Loss_D {errD.item():.4f} "
                      f"Loss_G {errG.item():.4f} D(x) {D_x:.4f} D(G(z)) {D_G_z:.4f}")
            if i % 500 == 0:
                vutils.save_image(real, f"{opt.outf}/real_samples.png", normalize=True)
                with torch.no_grad():
                    samples = netG(fixed_noise)
                vutils.save_image(samples.detach(), f"{opt.outf}/fake_samples_epoch_{epoch:03d}.png", normalize=True)

        torch.save(netG.state_dict(), f"{opt.outf}/netG_epoch_{epoch}.pth")
        torch.save(netD.state_dict(), f"{opt.outf}/netD_epoch_{epoch}.pth")


if __name__ == "__main__":
    main()
