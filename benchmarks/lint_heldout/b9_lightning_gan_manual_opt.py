"""ProGAN-lite on 64x64 faces, PyTorch Lightning with manual optimization.

Lightning's own mixed precision plugin does not play well with two optimizers and a
per-network clip, so this module runs autocast and its own GradScaler and the Trainer
stays in 32-bit.

    python gan_lit.py --data /datasets/ffhq64 --batch-size 64 --amp
"""
import argparse
import copy
import os

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader


class MinibatchStdDev(nn.Module):
    """Appends the average per-feature standard deviation over a group as an extra channel."""

    def __init__(self, group_size=4):
        super().__init__()
        self.group_size = group_size

    def forward(self, x):
        b, c, h, w = x.shape
        g = min(self.group_size, b)
        y = x.reshape(g, -1, c, h, w)
        y = y.var(dim=0, unbiased=False)  # expect: AMP004
        y = torch.sqrt(y + 1e-8)  # expect: AMP011
        y = y.mean(dim=[1, 2, 3])  # expect: AMP004
        y = y.reshape(-1, 1, 1, 1).repeat(g, 1, h, w)
        return torch.cat([x, y], dim=1)


class Generator(nn.Module):
    def __init__(self, latent_dim=256, ch=256):
        super().__init__()
        self.fc = nn.Linear(latent_dim, ch * 4 * 4)
        self.ch = ch

        def up(cin, cout):
            return nn.Sequential(
                nn.Upsample(scale_factor=2, mode="nearest"),
                nn.Conv2d(cin, cout, 3, padding=1),
                nn.BatchNorm2d(cout),
                nn.LeakyReLU(0.2, inplace=True),
            )

        self.body = nn.Sequential(up(ch, ch), up(ch, ch // 2), up(ch // 2, ch // 4), up(ch // 4, ch // 8))
        self.to_rgb = nn.Conv2d(ch // 8, 3, 1)

    def forward(self, z):
        x = self.fc(z).view(z.size(0), self.ch, 4, 4)
        return torch.tanh(self.to_rgb(self.body(x)))


class Discriminator(nn.Module):
    def __init__(self, ch=256):
        super().__init__()

        def down(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.LeakyReLU(0.2), nn.AvgPool2d(2))

        self.features = nn.Sequential(
            nn.Conv2d(3, ch // 8, 1), down(ch // 8, ch // 4), down(ch // 4, ch // 2), down(ch // 2, ch), down(ch, ch)
        )
        self.mbstd = MinibatchStdDev(group_size=4)
        self.head = nn.Sequential(
            nn.Conv2d(ch + 1, ch, 3, padding=1),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(ch * 4 * 4, 1),
            nn.Sigmoid(),
        )

    def forward(self, img):
        out = self.features(img)
        out = self.mbstd(out)
        return self.head(out)


class LitProGAN(pl.LightningModule):
    def __init__(self, latent_dim=256, lr=2e-4, use_amp=True, clip_d=10.0, clip_g=10.0, ema_decay=0.999):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()
        self.g_ema = copy.deepcopy(self.generator).eval().requires_grad_(False)
        self.adversarial_loss = nn.BCELoss()
        self.use_amp = use_amp
        self.scaler = torch.cuda.amp.GradScaler(enabled=use_amp)  # expect: AMP009
        self.register_buffer("fixed_z", torch.randn(64, latent_dim))

    def configure_optimizers(self):
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.0, 0.99), eps=1e-8)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.0, 0.99), eps=1e-8)
        return [opt_g, opt_d]

    @torch.no_grad()
    def _update_ema(self):
        decay = self.hparams.ema_decay
        for p_ema, p in zip(self.g_ema.parameters(), self.generator.parameters()):
            p_ema.lerp_(p, 1.0 - decay)
        for b_ema, b in zip(self.g_ema.buffers(), self.generator.buffers()):
            b_ema.copy_(b)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        bs = real.size(0)
        z = torch.randn(bs, self.hparams.latent_dim, device=self.device)
        valid = torch.ones(bs, 1, device=self.device)
        fake_lbl = torch.zeros(bs, 1, device=self.device)

        # ---- discriminator
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            fake = self.generator(z)
            d_real = self.discriminator(real)
            d_fake = self.discriminator(fake.detach())
            d_loss = 0.5 * (self.adversarial_loss(d_real, valid) + self.adversarial_loss(d_fake, fake_lbl))  # expect: AMP003
        opt_d.zero_grad(set_to_none=True)
        self.scaler.scale(d_loss).backward()
        self.scaler.unscale_(opt_d)
        d_norm = torch.nn.utils.clip_grad_norm_(self.discriminator.parameters(), self.hparams.clip_d)
        self.scaler.step(opt_d)

        # ---- generator
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            g_loss = self.adversarial_loss(self.discriminator(fake), valid)  # expect: AMP003
        opt_g.zero_grad(set_to_none=True)
        self.scaler.scale(g_loss).backward()
        g_norm = torch.nn.utils.clip_grad_norm_(self.generator.parameters(), self.hparams.clip_g)  # expect: AMP005
        self.scaler.step(opt_g)
        self.scaler.update()
        self._update_ema()

        self.log_dict(
            {
                "loss/d": d_loss.detach(),
                "loss/g": g_loss.detach(),
                "grad/d_norm": d_norm,
                "grad/g_norm": g_norm,
                "amp/scale": self.scaler.get_scale() if self.use_amp else 1.0,
            },
            prog_bar=True,
        )

    def on_train_epoch_end(self):
        with torch.no_grad():
            samples = self.g_ema(self.fixed_z.to(self.device))
        grid = torchvision.utils.make_grid(samples.float().add(1).div(2).clamp(0, 1), nrow=8)
        out_dir = os.path.join(self.trainer.default_root_dir, "samples")
        os.makedirs(out_dir, exist_ok=True)
        torchvision.utils.save_image(grid, os.path.join(out_dir, f"epoch{self.current_epoch:03d}.png"))

    def on_save_checkpoint(self, checkpoint):
        checkpoint["grad_scaler"] = self.scaler.state_dict()

    def on_load_checkpoint(self, checkpoint):
        if "grad_scaler" in checkpoint:
            self.scaler.load_state_dict(checkpoint["grad_scaler"])


class FaceDataModule(pl.LightningDataModule):
    def __init__(self, root, batch_size=64, num_workers=8, image_size=64):
        super().__init__()
        self.root = root
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.tf = T.Compose(
            [
                T.Resize(image_size),
                T.CenterCrop(image_size),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize([0.5] * 3, [0.5] * 3),
            ]
        )

    def setup(self, stage=None):
        self.train_set = torchvision.datasets.ImageFolder(self.root, transform=self.tf)

    def train_dataloader(self):
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=True,
            persistent_workers=True,
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out", default="runs/progan_lite")
    args = p.parse_args()

    pl.seed_everything(1234)
    dm = FaceDataModule(args.data, batch_size=args.batch_size)
    model = LitProGAN(lr=args.lr, use_amp=args.amp)
    ckpt = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), save_last=True, every_n_epochs=5)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="gpu",
        devices=1,
        precision=32,  # AMP is handled inside the module
        default_root_dir=args.out,
        callbacks=[ckpt],
        log_every_n_steps=25,
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
