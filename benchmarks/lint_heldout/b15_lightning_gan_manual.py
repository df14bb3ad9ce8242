"""DCGAN-style generator/discriminator pair with manual optimization.

Lightning runs in full precision ("32-true"); the module handles autocast and
loss scaling itself because the two optimizers need different treatment.
"""
import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011


class MinibatchStdDev(nn.Module):
    def __init__(self, group_size=4):
        super().__init__()
        self.group_size = group_size

    def forward(self, x):
        b, c, h, w = x.shape
        g = min(self.group_size, b)
        y = x.reshape(g, -1, c, h, w)
        std = torch.sqrt(y.var(dim=0, unbiased=False) + 1e-6).mean(dim=[1, 2, 3])  # expect: AMP004
        std = std.reshape(-1, 1, 1, 1).repeat(g, 1, h, w)
        return torch.cat([x, std], dim=1)


class Generator(nn.Module):
    def __init__(self, latent_dim=128, ngf=64, channels=3):
        super().__init__()
        self.ngf = ngf
        self.fc = nn.Linear(latent_dim, ngf * 8 * 4 * 4)
        self.pixel_norm = PixelNorm()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, channels, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z):
        h = self.fc(z)
        h = self.pixel_norm(h)
        h = F.relu(h).view(z.size(0), self.ngf * 8, 4, 4)
        return self.net(h)


class Discriminator(nn.Module):
    def __init__(self, channels=3, ndf=64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
        )
        self.mbstd = MinibatchStdDev()
        self.head = nn.Sequential(
            nn.Conv2d(ndf * 4 + 1, ndf * 8, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Flatten(),
            nn.Sigmoid(),
        )

    def forward(self, img):
        out = self.features(img)
        out = self.mbstd(out)
        return self.head(F.leaky_relu(out, 0.2))


class DCGAN(pl.LightningModule):
    def __init__(self, latent_dim=128, lr=2e-4, b1=0.5, b2=0.999, d_clip=1.0, sample_every=1):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()
        self.scaler = torch.amp.GradScaler("cuda")
        self.register_buffer("fixed_z", torch.randn(64, latent_dim), persistent=False)

    def adversarial_loss(self, y_hat, y):
        return F.binary_cross_entropy(y_hat, y)  # expect: AMP003

    def training_step(self, batch, batch_idx):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        bsz = imgs.size(0)
        z = torch.randn(bsz, self.hparams.latent_dim, device=self.device)
        valid = torch.ones(bsz, 1, device=self.device)
        fake_lbl = torch.zeros(bsz, 1, device=self.device)

        # generator: fool the discriminator
        self.toggle_optimizer(opt_g)
        with torch.autocast("cuda", dtype=torch.float16):
            fake = self.generator(z)
            g_loss = self.adversarial_loss(self.discriminator(fake), valid)
        opt_g.zero_grad(set_to_none=True)
        self.scaler.scale(g_loss).backward()
        opt_g.step()  # expect: AMP006
        self.untoggle_optimizer(opt_g)

        # discriminator: real vs. detached fakes
        self.toggle_optimizer(opt_d)
        with torch.autocast("cuda", dtype=torch.float16):
            real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
            fake_loss = self.adversarial_loss(self.discriminator(fake.detach()), fake_lbl)
            d_loss = 0.5 * (real_loss + fake_loss)
        opt_d.zero_grad(set_to_none=True)
        self.scaler.scale(d_loss).backward()
        self.scaler.unscale_(opt_d)
        torch.nn.utils.clip_grad_norm_(self.discriminator.parameters(), self.hparams.d_clip)
        self.scaler.step(opt_d)
        self.scaler.update()
        self.untoggle_optimizer(opt_d)

        self.log_dict(
            {"g_loss": g_loss.detach(), "d_loss": d_loss.detach(), "loss_scale": self.scaler.get_scale()},
            prog_bar=True,
        )

    def on_train_epoch_end(self):
        if self.current_epoch % self.hparams.sample_every:
            return
        self.generator.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            samples = self.generator(self.fixed_z)
        self.generator.train()
        grid = torchvision.utils.make_grid(samples.float(), nrow=8, normalize=True, value_range=(-1, 1))
        self.logger.experiment.add_image("samples", grid, self.current_epoch)

    def on_save_checkpoint(self, checkpoint):
        # small fp16 copy of G for the demo page, next to the full-precision state
        checkpoint["generator_fp16"] = {k: v.half() for k, v in self.generator.state_dict().items()}
        checkpoint["amp_scaler"] = self.scaler.state_dict()

    def on_load_checkpoint(self, checkpoint):
        if "amp_scaler" in checkpoint:
            self.scaler.load_state_dict(checkpoint["amp_scaler"])

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []


class ImageFolderDataModule(pl.LightningDataModule):
    def __init__(self, root, image_size=64, batch_size=128, num_workers=8):
        super().__init__()
        self.root = root
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.transform = transforms.Compose([
            transforms.Resize(image_size),
            transforms.CenterCrop(image_size),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ])

    def setup(self, stage=None):
        self.dataset = ImageFolder(self.root, transform=self.transform)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, pin_memory=True, persistent_workers=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--latent-dim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--out", default="runs/dcgan")
    args = parser.parse_args()

    pl.seed_everything(1234)
    dm = ImageFolderDataModule(args.data, batch_size=args.batch_size)
    model = DCGAN(latent_dim=args.latent_dim, lr=args.lr)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        precision="32-true",
        max_epochs=args.epochs,
        logger=TensorBoardLogger(os.path.join(args.out, "tb")),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), save_last=True)],
    )
    trainer.fit(model, dm)


if __name__ == "__main__":
    main()
