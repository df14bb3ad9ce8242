"""DCGAN with automatic mixed precision: one GradScaler shared by both networks."""
import argparse

import torch
import torch.nn as nn
import torch.optim as optim


class Generator(nn.Module):
    def __init__(self, nz=100, ngf=64, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf=64, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
        )

    def forward(self, x):
        return self.main(x).view(-1)


def train(args):
    device = torch.device("cuda")
    netG, netD = Generator().to(device), Discriminator().to(device)
    criterion = nn.BCEWithLogitsLoss()
    optimizerD = optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    scaler = torch.amp.GradScaler("cuda")
    fixed_noise = torch.randn(64, 100, 1, 1, device=device)
    for epoch in range(args.niter):
        for i, (real, _) in enumerate([]):
            real = real.to(device)
            b = real.size(0)
            noise = torch.randn(b, 100, 1, 1, device=device)
            netD.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                out_real = netD(real)
                errD_real = criterion(out_real, torch.ones_like(out_real))
                fake = netG(noise)
                out_fake = netD(fake.detach())
                errD_fake = criterion(out_fake, torch.zeros_like(out_fake))
                errD = errD_real + errD_fake
            scaler.scale(errD).backward()
            scaler.step(optimizerD)
            netG.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                out = netD(fake)
                errG = criterion(out, torch.ones_like(out))
            scaler.scale(errG).backward()
            optimizerG.step()  # expect: AMP006
            scaler.update()
        torch.save(netG.state_dict(), f"netG_epoch_{epoch}.pth")
    with torch.no_grad():
        return netG(fixed_noise)


def train_wgan_gp(netG, netD, loader, optG, optD, device, lambda_gp=10.0):
    """WGAN-GP with the gradient penalty recipe from the AMP docs."""
    scaler = torch.amp.GradScaler("cuda")
    for real in loader:
        real = real.to(device)
        z = torch.randn(real.size(0), 100, 1, 1, device=device)
        with torch.autocast("cuda", dtype=torch.float16):
            fake = netG(z).detach()
            alpha = torch.rand(real.size(0), 1, 1, 1, device=device)
            interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            d_interp = netD(interp)
        scaled_grads = torch.autograd.grad(outputs=scaler.scale(d_interp.sum()), inputs=interp,
                                           create_graph=True)[0]
        inv_scale = 1.0 / scaler.get_scale()
        grads = scaled_grads * inv_scale
        with torch.autocast("cuda", dtype=torch.float16):
            gp = ((grads.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
            loss_d = netD(fake).mean() - netD(real).mean() + lambda_gp * gp
        optD.zero_grad()
        scaler.scale(loss_d).backward()
        scaler.step(optD)
        scaler.update()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--niter", type=int, default=25)
    train(parser.parse_args())
