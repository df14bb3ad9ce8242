"""pix2pix (Isola et al. 2017) for facades / maps, single-file version with --amp.

U-Net-256 generator, 70x70 PatchGAN discriminator with a sigmoid output (vanilla GAN
loss), L1 reconstruction plus an edge term that helps on building facades.

    python pix2pix.py --dataroot datasets/facades --direction BtoA --amp
"""

import argparse
import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.utils import save_image


class AlignedDataset(Dataset):
    def __init__(self, root, phase="train", direction="AtoB", load_size=286, crop_size=256):
        self.dir = os.path.join(root, phase)
        self.paths = sorted(os.path.join(self.dir, f) for f in os.listdir(self.dir) if f.endswith((".jpg", ".png")))
        self.direction, self.load_size, self.crop_size = direction, load_size, crop_size
        self.phase = phase
        self.norm = T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        ab = Image.open(self.paths[i]).convert("RGB")
        w, h = ab.size
        a, b = ab.crop((0, 0, w // 2, h)), ab.crop((w // 2, 0, w, h))
        if self.phase == "train":
            a, b = a.resize((self.load_size,) * 2, Image.BICUBIC), b.resize((self.load_size,) * 2, Image.BICUBIC)
            x = random.randint(0, self.load_size - self.crop_size)
            y = random.randint(0, self.load_size - self.crop_size)
            box = (x, y, x + self.crop_size, y + self.crop_size)
            a, b = a.crop(box), b.crop(box)
            if random.random() < 0.5:
                a, b = a.transpose(Image.FLIP_LEFT_RIGHT), b.transpose(Image.FLIP_LEFT_RIGHT)
        a, b = self.norm(a), self.norm(b)
        return (a, b) if self.direction == "AtoB" else (b, a)


class UnetSkipConnectionBlock(nn.Module):
    def __init__(self, outer_nc, inner_nc, input_nc=None, submodule=None, outermost=False,
                 innermost=False, use_dropout=False):
        super().__init__()
        self.outermost = outermost
        input_nc = input_nc or outer_nc
        downconv = nn.Conv2d(input_nc, inner_nc, 4, 2, 1, bias=False)
        downrelu, downnorm = nn.LeakyReLU(0.2, True), nn.BatchNorm2d(inner_nc)
        uprelu, upnorm = nn.ReLU(True), nn.BatchNorm2d(outer_nc)
        if outermost:
            upconv = nn.ConvTranspose2d(inner_nc * 2, outer_nc, 4, 2, 1)
            model = [downconv, submodule, uprelu, upconv, nn.Tanh()]
        elif innermost:
            upconv = nn.ConvTranspose2d(inner_nc, outer_nc, 4, 2, 1, bias=False)
            model = [downrelu, downconv, uprelu, upconv, upnorm]
        else:
            upconv = nn.ConvTranspose2d(inner_nc * 2, outer_nc, 4, 2, 1, bias=False)
            model = [downrelu, downconv, downnorm, submodule, uprelu, upconv, upnorm]
            if use_dropout:
                model.append(nn.Dropout(0.5))
        self.model = nn.Sequential(*model)

    def forward(self, x):
        if self.outermost:
            return self.model(x)
        return torch.cat([x, self.model(x)], 1)


class UnetGenerator(nn.Module):
    def __init__(self, input_nc=3, output_nc=3, num_downs=8, ngf=64):
        super().__init__()
        block = UnetSkipConnectionBlock(ngf * 8, ngf * 8, innermost=True)
        for _ in range(num_downs - 5):
            block = UnetSkipConnectionBlock(ngf * 8, ngf * 8, submodule=block, use_dropout=True)
        block = UnetSkipConnectionBlock(ngf * 4, ngf * 8, submodule=block)
        block = UnetSkipConnectionBlock(ngf * 2, ngf * 4, submodule=block)
        block = UnetSkipConnectionBlock(ngf, ngf * 2, submodule=block)
        self.model = UnetSkipConnectionBlock(output_nc, ngf, input_nc=input_nc, submodule=block, outermost=True)

    def forward(self, x):
        return self.model(x)


class NLayerDiscriminator(nn.Module):
    def __init__(self, input_nc=6, ndf=64, n_layers=3):
        super().__init__()
        seq = [nn.Conv2d(input_nc, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True)]
        mult = 1
        for n in range(1, n_layers + 1):
            prev, mult = mult, min(2 ** n, 8)
            stride = 2 if n < n_layers else 1
            seq += [nn.Conv2d(ndf * prev, ndf * mult, 4, stride, 1, bias=False),
                    nn.BatchNorm2d(ndf * mult), nn.LeakyReLU(0.2, True)]
        seq += [nn.Conv2d(ndf * mult, 1, 4, 1, 1), nn.Sigmoid()]
        self.model = nn.Sequential(*seq)

    def forward(self, x):
        return self.model(x)


def init_weights(net, gain=0.02):
    def init_func(m):
        name = m.__class__.__name__
        if hasattr(m, "weight") and ("Conv" in name or "Linear" in name):
            nn.init.normal_(m.weight.data, 0.0, gain)
            if getattr(m, "bias", None) is not None:
                nn.init.constant_(m.bias.data, 0.0)
        elif "BatchNorm2d" in name:
            nn.init.normal_(m.weight.data, 1.0, gain)
            nn.init.constant_(m.bias.data, 0.0)
    net.apply(init_func)
    return net


bce = nn.BCELoss()
l1 = nn.L1Loss()


def edge_loss(fake, real):
    """L1 between gradient magnitudes of the generated and the real image."""
    fgx = fake[:, :, :-1, 1:] - fake[:, :, :-1, :-1]
    fgy = fake[:, :, 1:, :-1] - fake[:, :, :-1, :-1]
    rgx = real[:, :, :-1, 1:] - real[:, :, :-1, :-1]
    rgy = real[:, :, 1:, :-1] - real[:, :, :-1, :-1]
    fake_mag = torch.sqrt(fgx * fgx + fgy * fgy + 1e-10)  # expect: AMP011
    real_mag = torch.sqrt(rgx * rgx + rgy * rgy + 1e-10)
    return F.l1_loss(fake_mag, real_mag)


def train_discriminator(netG, netD, optimizer_D, real_A, real_B, opt):
    optimizer_D.zero_grad(set_to_none=True)
    with torch.cuda.amp.autocast(enabled=opt.amp):  # expect: AMP009 AMP010
        with torch.no_grad():
            fake_B = netG(real_A)
        pred_fake = netD(torch.cat([real_A, fake_B], 1))
        loss_D_fake = bce(pred_fake, torch.zeros_like(pred_fake))  # expect: AMP003
        pred_real = netD(torch.cat([real_A, real_B], 1))
        loss_D_real = bce(pred_real, torch.ones_like(pred_real))  # expect: AMP003
        loss_D = (loss_D_fake + loss_D_real) * 0.5
        loss_D.backward()  # expect: AMP008
    optimizer_D.step()
    return loss_D.item()


def train_generator(netG, netD, optimizer_G, real_A, real_B, opt):
    optimizer_G.zero_grad(set_to_none=True)
    with torch.cuda.amp.autocast(enabled=opt.amp):  # expect: AMP009 AMP010
        fake_B = netG(real_A)
        pred_fake = netD(torch.cat([real_A, fake_B], 1))
        loss_G_GAN = bce(pred_fake, torch.ones_like(pred_fake))  # expect: AMP003
        loss_G_L1 = l1(fake_B, real_B) * opt.lambda_L1
        loss_G_edge = edge_loss(fake_B, real_B) * opt.lambda_edge
        loss_G = loss_G_GAN + loss_G_L1 + loss_G_edge
    loss_G.backward()
    optimizer_G.step()
    return fake_B.detach(), {"G_GAN": loss_G_GAN.item(), "G_L1": loss_G_L1.item(), "G_edge": loss_G_edge.item()}


@torch.no_grad()
def sample_images(netG, loader, out_dir, epoch, device):
    netG.eval()
    real_A, real_B = next(iter(loader))
    fake_B = netG(real_A.to(device))
    grid = torch.cat([real_A.to(device), fake_B, real_B.to(device)], dim=0) * 0.5 + 0.5
    save_image(grid, os.path.join(out_dir, f"epoch_{epoch:03d}.png"), nrow=real_A.size(0))
    netG.train()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", required=True)
    p.add_argument("--direction", default="AtoB")
    p.add_argument("--n_epochs", type=int, default=100)
    p.add_argument("--n_epochs_decay", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--lambda_L1", type=float, default=100.0)
    p.add_argument("--lambda_edge", type=float, default=10.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--checkpoints_dir", default="checkpoints/facades_pix2pix")
    opt = p.parse_args()
    device = torch.device("cuda")
    os.makedirs(opt.checkpoints_dir, exist_ok=True)

    train_loader = DataLoader(AlignedDataset(opt.dataroot, "train", opt.direction),
                              batch_size=opt.batch_size, shuffle=True, num_workers=4)
    val_loader = DataLoader(AlignedDataset(opt.dataroot, "val", opt.direction), batch_size=8, shuffle=True)
    netG = init_weights(UnetGenerator()).to(device)
    netD = init_weights(NLayerDiscriminator()).to(device)
    optimizer_G = torch.optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizer_D = torch.optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    def lambda_rule(epoch):
        return 1.0 - max(0, epoch + 1 - opt.n_epochs) / float(opt.n_epochs_decay + 1)

    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda=lambda_rule) for o in (optimizer_G, optimizer_D)]

    for epoch in range(1, opt.n_epochs + opt.n_epochs_decay + 1):
        t0 = time.time()
        for i, (real_A, real_B) in enumerate(train_loader):
            real_A, real_B = real_A.to(device), real_B.to(device)
            loss_D = train_discriminator(netG, netD, optimizer_D, real_A, real_B, opt)
            _, g_losses = train_generator(netG, netD, optimizer_G, real_A, real_B, opt)
            if i % 100 == 0:
                print(f"(epoch {epoch}, iter {i}, {time.time() - t0:.1f}s) D {loss_D:.3f} "
                      + " ".join(f"{k} {v:.3f}" for k, v in g_losses.items()))
        for s in schedulers:
            s.step()
        sample_images(netG, val_loader, opt.checkpoints_dir, epoch, device)
        if epoch % 5 == 0:
            torch.save({"G": netG.state_dict(), "D": netD.state_dict(), "epoch": epoch},
                       os.path.join(opt.checkpoints_dir, f"{epoch}_net.pth"))


if __name__ == "__main__":
    main()
