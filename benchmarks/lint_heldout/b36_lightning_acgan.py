"""Class-conditional StyleGAN-lite (AC-GAN losses) with Lightning manual optimization.

The two optimizers are stepped by hand (automatic_optimization = False). The Trainer runs
in fp32; the module opens its own bf16 autocast around the G and D forwards so that the
two steps can be cast independently.
"""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class AdaIN(nn.Module):
    def __init__(self, channels, w_dim):
        super().__init__()
        self.style = nn.Linear(w_dim, 2 * channels)

    def forward(self, x, w):
        mu = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        sigma = x.std(dim=(2, 3), keepdim=True) + 1e-5  # expect: AMP004
        gamma, beta = self.style(w).chunk(2, dim=1)
        return (1 + gamma[..., None, None]) * (x - mu) / sigma + beta[..., None, None]


class UpBlock(nn.Module):
    def __init__(self, c_in, c_out, w_dim):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.adain = AdaIN(c_out, w_dim)

    def forward(self, x, w):
        x = self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))
        return F.leaky_relu(self.adain(x, w), 0.2)


class Generator(nn.Module):
    def __init__(self, z_dim=128, w_dim=256, n_classes=10, channels=(256, 256, 128, 64)):
        super().__init__()
        self.pixel_norm = PixelNorm()
        self.embed = nn.Embedding(n_classes, z_dim)
        layers = []
        for i in range(4):
            layers += [nn.Linear(2 * z_dim if i == 0 else w_dim, w_dim), nn.LeakyReLU(0.2)]
        self.mapping = nn.Sequential(*layers)
        self.const = nn.Parameter(torch.randn(1, channels[0], 4, 4))
        self.blocks = nn.ModuleList(
            [UpBlock(channels[i], channels[i + 1], w_dim) for i in range(len(channels) - 1)]
        )
        self.to_rgb = nn.Conv2d(channels[-1], 3, 1)

    def forward(self, z, y):
        w = self.mapping(torch.cat([self.pixel_norm(z), self.embed(y)], dim=1))
        x = self.const.expand(z.size(0), -1, -1, -1)
        for blk in self.blocks:
            x = blk(x, w)
        return torch.tanh(self.to_rgb(x))


class MinibatchStdDev(nn.Module):
    def forward(self, x):
        b, _, hh, ww = x.shape
        std = torch.sqrt(x.var(dim=0, unbiased=False) + 1e-8).mean()  # expect: AMP004
        return torch.cat([x, std.expand(b, 1, hh, ww)], dim=1)


class DBlock(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.down = nn.Conv2d(c_out, c_out, 4, stride=2, padding=1)

    def forward(self, x):
        return self.down(F.leaky_relu(self.conv(x), 0.2))


class Discriminator(nn.Module):
    def __init__(self, n_classes=10, channels=(64, 128, 256, 256)):
        super().__init__()
        self.from_rgb = nn.Conv2d(3, channels[0], 1)
        self.blocks = nn.ModuleList([DBlock(channels[i], channels[i + 1]) for i in range(len(channels) - 1)])
        self.pre_std = nn.Conv2d(channels[-1], channels[-1], 3, padding=1)
        self.mbstd = MinibatchStdDev()
        self.final_conv = nn.Conv2d(channels[-1] + 1, channels[-1], 3, padding=1)
        self.adv_head = nn.Linear(channels[-1], 1)
        self.cls_head = nn.Linear(channels[-1], n_classes)

    def forward(self, img):
        h = self.from_rgb(img)
        for blk in self.blocks:
            h = blk(h)
        h = self.mbstd(self.pre_std(h))
        h = self.final_conv(h)
        feat = F.leaky_relu(h.mean(dim=(2, 3)), 0.2)  # expect: AMP004
        adv = torch.sigmoid(self.adv_head(feat)).squeeze(1)
        return adv, self.cls_head(feat), feat


class ACGAN(pl.LightningModule):
    def __init__(self, z_dim=128, n_classes=10, lr_g=2e-4, lr_d=2e-4, lambda_cls=1.0, clip=10.0):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(z_dim=z_dim, n_classes=n_classes)
        self.discriminator = Discriminator(n_classes=n_classes)
        self.adv_criterion = nn.BCELoss()
        self.cls_criterion = nn.CrossEntropyLoss()
        self.register_buffer("fixed_z", torch.randn(64, z_dim))
        self.register_buffer("fixed_y", torch.arange(64) % n_classes)

    def training_step(self, batch, batch_idx):
        imgs, y = batch
        opt_g, opt_d = self.optimizers()
        b = imgs.size(0)
        z = torch.randn(b, self.hparams.z_dim, device=self.device)

        # ---- discriminator ----
        self.toggle_optimizer(opt_d)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
            fake = self.generator(z, y)
            real_p, real_cls, _ = self.discriminator(imgs)
            fake_p, _, _ = self.discriminator(fake.detach())
            d_real = self.adv_criterion(real_p, torch.ones_like(real_p))  # expect: AMP003
            d_fake = self.adv_criterion(fake_p, torch.zeros_like(fake_p))  # expect: AMP003
            d_adv = d_real + d_fake
        d_cls = self.cls_criterion(real_cls, y)  # expect: AMP002
        d_loss = d_adv + self.hparams.lambda_cls * d_cls
        opt_d.zero_grad(set_to_none=True)
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        # ---- generator ----
        self.toggle_optimizer(opt_g)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
            fake = self.generator(z, y)
            fake_p, fake_cls, _ = self.discriminator(fake)
            g_adv = self.adv_criterion(fake_p, torch.ones_like(fake_p))  # expect: AMP003
        g_cls = self.cls_criterion(fake_cls, y)  # expect: AMP002
        g_loss = g_adv + self.hparams.lambda_cls * g_cls
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        acc = (real_cls.argmax(dim=1) == y).float().mean()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss, "d_cls_acc": acc}, prog_bar=True)

    def validation_step(self, batch, batch_idx):
        imgs, y = batch
        with torch.no_grad():
            _, cls_logits, _ = self.discriminator(imgs)
        self.log("val/cls_acc", (cls_logits.argmax(1) == y).float().mean(), sync_dist=True)

    def on_validation_epoch_end(self):
        with torch.no_grad():
            samples = self.generator(self.fixed_z, self.fixed_y)
        grid = torchvision.utils.make_grid(samples.float() * 0.5 + 0.5, nrow=8)
        if self.logger is not None:
            self.logger.experiment.add_image("samples", grid, self.current_epoch)

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr_g, betas=(0.0, 0.99), eps=1e-8)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr_d, betas=(0.0, 0.99), eps=1e-8)
        return opt_g, opt_d


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/cifar10")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=128)
    args = p.parse_args()
    tf = torchvision.transforms.Compose(
        [torchvision.transforms.ToTensor(), torchvision.transforms.Normalize([0.5] * 3, [0.5] * 3)]
    )
    train_set = torchvision.datasets.CIFAR10(args.data, train=True, download=True, transform=tf)
    val_set = torchvision.datasets.CIFAR10(args.data, train=False, download=True, transform=tf)
    train_dl = torch.utils.data.DataLoader(train_set, args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_dl = torch.utils.data.DataLoader(val_set, 256, num_workers=8)
    model = ACGAN()
    # precision stays fp32 here: the module casts its own forwards (see training_step)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="32-true", max_epochs=args.epochs)
    trainer.fit(model, train_dl, val_dl)


if __name__ == "__main__":
    main()
