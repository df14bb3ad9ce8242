"""Class-conditional GAN (AdaIN generator, conv discriminator) as a LightningModule.

Autocast is opened by hand around the forward passes: the Trainer runs in "32-true" so
that the EMA generator and the R1 penalty stay in fp32 without fighting the precision
plugin. Manual optimisation, one D step and one G step per batch.
"""
import argparse
import copy

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.utils import save_image


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class AdaIN(nn.Module):
    def __init__(self, channels, style_dim):
        super().__init__()
        self.affine = nn.Linear(style_dim, 2 * channels)

    def forward(self, x, w):
        gamma, beta = self.affine(w).chunk(2, dim=1)
        mu = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        sigma = x.std(dim=(2, 3), keepdim=True) + 1e-5  # expect: AMP004
        return (1 + gamma[..., None, None]) * (x - mu) / sigma + beta[..., None, None]


class GenBlock(nn.Module):
    def __init__(self, cin, cout, style_dim):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.adain1 = AdaIN(cout, style_dim)
        self.adain2 = AdaIN(cout, style_dim)

    def forward(self, x, w):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        x = F.leaky_relu(self.adain1(self.conv1(x), w), 0.2)
        return F.leaky_relu(self.adain2(self.conv2(x), w), 0.2)


class Generator(nn.Module):
    def __init__(self, num_classes, z_dim=128, style_dim=256, channels=(256, 256, 128, 64)):
        super().__init__()
        self.embed = nn.Embedding(num_classes, z_dim)
        layers = [PixelNorm()]
        for i in range(4):
            layers += [nn.Linear(2 * z_dim if i == 0 else style_dim, style_dim), nn.LeakyReLU(0.2)]
        self.mapping = nn.Sequential(*layers)
        self.const = nn.Parameter(torch.randn(1, channels[0], 4, 4))
        self.blocks = nn.ModuleList([GenBlock(channels[i], channels[i + 1], style_dim) for i in range(len(channels) - 1)])
        self.to_rgb = nn.Conv2d(channels[-1], 3, 1)

    def forward(self, z, y):
        w = self.mapping(torch.cat([z, self.embed(y)], dim=1))
        x = self.const.expand(z.size(0), -1, -1, -1)
        for blk in self.blocks:
            x = blk(x, w)
        return torch.tanh(self.to_rgb(x))


class Discriminator(nn.Module):
    def __init__(self, num_classes, img_size=32, ch=64):
        super().__init__()
        self.img_size = img_size
        self.embed = nn.Embedding(num_classes, img_size * img_size)
        self.net = nn.Sequential(
            nn.Conv2d(4, ch, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(ch, 2 * ch, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(2 * ch, 4 * ch, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(4 * ch, 1, 4, 1, 0),
        )

    def forward(self, img, y):
        y_map = self.embed(y).view(-1, 1, self.img_size, self.img_size)
        return self.net(torch.cat([img, y_map], dim=1)).view(-1)


@torch.cuda.amp.autocast(enabled=False)  # expect: AMP009
def r1_penalty(d_real, real):
    (grad,) = torch.autograd.grad(outputs=d_real.float().sum(), inputs=real, create_graph=True)
    return grad.pow(2).flatten(1).sum(1).mean()


class CondGAN(L.LightningModule):
    def __init__(self, num_classes=10, z_dim=128, lr=2e-4, r1_gamma=1.0, r1_every=16, ema_decay=0.999):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.G = Generator(num_classes, z_dim)
        self.D = Discriminator(num_classes)
        self.G_ema = copy.deepcopy(self.G).requires_grad_(False)
        self.adv_loss = nn.BCELoss()

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.G.parameters(), lr=self.hparams.lr, betas=(0.0, 0.99))
        opt_d = torch.optim.Adam(self.D.parameters(), lr=self.hparams.lr, betas=(0.0, 0.99))
        return opt_g, opt_d

    def training_step(self, batch, batch_idx):
        real, y = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.size(0), self.hparams.z_dim, device=self.device)

        real.requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fake = self.G(z, y)
            d_real = self.D(real, y)
            d_fake = self.D(fake.detach(), y)
            loss_real = self.adv_loss(torch.sigmoid(d_real), torch.ones_like(d_real))  # expect: AMP003
            loss_fake = self.adv_loss(torch.sigmoid(d_fake), torch.zeros_like(d_fake))  # expect: AMP003
            d_loss = loss_real + loss_fake
        if batch_idx % self.hparams.r1_every == 0:
            d_loss = d_loss + 0.5 * self.hparams.r1_gamma * self.hparams.r1_every * r1_penalty(d_real, real)
        opt_d.zero_grad(set_to_none=True)
        self.manual_backward(d_loss)
        opt_d.step()
        real.requires_grad_(False)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            fake = self.G(z, y)
            d_gen = torch.sigmoid(self.D(fake, y))
        g_loss = self.adv_loss(d_gen, torch.ones_like(d_gen))  # expect: AMP002
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}, prog_bar=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p_ema, p in zip(self.G_ema.parameters(), self.G.parameters()):
                p_ema.lerp_(p, 1.0 - self.hparams.ema_decay)
            for b_ema, b in zip(self.G_ema.buffers(), self.G.buffers()):
                b_ema.copy_(b)

    def on_train_epoch_end(self):
        n = self.hparams.num_classes
        y = torch.arange(n, device=self.device).repeat_interleave(8)
        z = torch.randn(y.numel(), self.hparams.z_dim, device=self.device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            imgs = self.G_ema(z, y)
        grid = (imgs.float().clamp(-1, 1) + 1) / 2
        save_image(grid, f"{self.logger.log_dir}/samples_{self.current_epoch:04d}.png", nrow=8)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=2e-4)
    args = p.parse_args()
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    ds = datasets.CIFAR10(args.data, train=True, download=True, transform=tf)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True, persistent_workers=True)
    model = CondGAN(num_classes=10, lr=args.lr)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="gpu", devices=1, precision="32-true", log_every_n_steps=50)
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
