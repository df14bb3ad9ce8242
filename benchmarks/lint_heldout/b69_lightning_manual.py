"""Lightning modules for the GAN and multi-label experiments.

``LitGAN`` uses manual optimization (two optimizers); mixed precision comes from
``Trainer(precision="16-mixed")``.  ``fit_plain`` is a Lightning-free loop for the
clusters where we cannot install it; it drives the same module.
"""
import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from torch import nn

from models.gan import Discriminator, Generator
from models.backbones import build_backbone
from data import CelebADataModule, TagsDataModule


class LitGAN(pl.LightningModule):
    def __init__(self, latent_dim=128, img_shape=(3, 64, 64), lr=2e-4, b1=0.5, b2=0.999,
                 clip_val=1.0, d_steps=1):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim, img_shape)
        self.discriminator = Discriminator(img_shape, logits=True)
        self.register_buffer("validation_z", torch.randn(16, latent_dim), persistent=False)

    def forward(self, z):
        return self.generator(z)

    @torch.cuda.amp.autocast(enabled=False)  # expect: AMP009
    def adversarial_loss(self, logits, target):
        # probability-space loss, kept in fp32 on purpose
        probs = torch.sigmoid(logits.float())
        return F.binary_cross_entropy(probs, target.float())

    def training_step(self, batch, batch_idx):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        b = imgs.size(0)
        valid = torch.ones(b, 1, device=self.device)
        fake_t = torch.zeros(b, 1, device=self.device)

        # discriminator
        for _ in range(self.hparams.d_steps):
            self.toggle_optimizer(opt_d)
            z = torch.randn(b, self.hparams.latent_dim, device=self.device)
            fake = self(z).detach()
            d_loss = 0.5 * (self.adversarial_loss(self.discriminator(imgs), valid)
                            + self.adversarial_loss(self.discriminator(fake), fake_t))
            self.manual_backward(d_loss)
            self.clip_gradients(opt_d, gradient_clip_val=self.hparams.clip_val, gradient_clip_algorithm="norm")
            opt_d.step()
            opt_d.zero_grad(set_to_none=True)
            self.untoggle_optimizer(opt_d)

        # generator
        self.toggle_optimizer(opt_g)
        z = torch.randn(b, self.hparams.latent_dim, device=self.device)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        self.untoggle_optimizer(opt_g)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=hp.lr, betas=(hp.b1, hp.b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=hp.lr, betas=(hp.b1, hp.b2))
        return [opt_g, opt_d], []

    def on_train_epoch_end(self):
        with torch.no_grad():
            samples = self(self.validation_z.to(self.device)).float()
        grid = torchvision.utils.make_grid(samples, normalize=True)
        self.logger.experiment.add_image("generated_images", grid, self.current_epoch)


class LitMultiLabel(pl.LightningModule):
    """Multi-label tagger: frozen-BN backbone run in bf16, head in fp32."""

    def __init__(self, backbone="convnext_tiny", num_tags=1000, lr=1e-3, weight_decay=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.backbone, feat_dim = build_backbone(backbone, pretrained=True)
        self.head = nn.Linear(feat_dim, num_tags)
        self.criterion = nn.BCELoss()
        self.val_criterion = nn.BCEWithLogitsLoss()

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats = self.backbone(x)
        return self.head(feats.float())

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats = self.backbone(x)
            probs = torch.sigmoid(self.head(feats))
            loss = self.criterion(probs, y.float())  # expect: AMP003
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = self.val_criterion(logits, y.float())
        preds = logits.sigmoid() > 0.5
        tp = (preds & y.bool()).sum()
        denom = preds.sum() + y.bool().sum()
        self.log_dict({"val/loss": loss, "val/f1": 2 * tp / denom.clamp(min=1)}, sync_dist=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # the precision plugin has unscaled the gradients before this hook
        if gradient_clip_val:
            torch.nn.utils.clip_grad_norm_(self.backbone.parameters(), gradient_clip_val)
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), gradient_clip_val * 5)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit_plain(module: LitGAN, loader, args):
    """Lightning-free loop for the GAN (same losses, same optimizers)."""
    device = torch.device("cuda")
    module.to(device).train()
    (opt_g, opt_d), _ = module.configure_optimizers()
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    latent_dim = module.hparams.latent_dim
    step = 0
    for epoch in range(args.epochs):
        for imgs, _ in loader:
            imgs = imgs.to(device, non_blocking=True)
            b = imgs.size(0)
            valid = torch.ones(b, 1, device=device)
            fake_t = torch.zeros(b, 1, device=device)

            z = torch.randn(b, latent_dim, device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                fake = module(z)
                d_loss = 0.5 * (module.adversarial_loss(module.discriminator(imgs), valid)
                                + module.adversarial_loss(module.discriminator(fake.detach()), fake_t))
            opt_d.zero_grad(set_to_none=True)
            scaler.scale(d_loss).backward()
            torch.nn.utils.clip_grad_norm_(module.discriminator.parameters(), args.clip_val)  # expect: AMP005
            scaler.step(opt_d)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                g_loss = module.adversarial_loss(module.discriminator(fake), valid)
            opt_g.zero_grad(set_to_none=True)
            scaler.scale(g_loss).backward()
            scaler.step(opt_g)
            scaler.update()

            step += 1
            if step % 100 == 0:
                print(f"epoch {epoch} step {step}: d {d_loss.item():.4f} g {g_loss.item():.4f}")
        torch.save(module.state_dict(), os.path.join(args.out_dir, f"gan_{epoch:03d}.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["gan", "tags"], default="gan")
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument("--clip-val", type=float, default=1.0)
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--no-lightning", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    if args.task == "gan":
        dm = CelebADataModule(args.data, batch_size=args.batch_size)
        module = LitGAN(clip_val=args.clip_val)
        if args.no_lightning:
            dm.setup("fit")
            fit_plain(module, dm.train_dataloader(), args)
            return
    else:
        dm = TagsDataModule(args.data, batch_size=args.batch_size)
        module = LitMultiLabel()

    trainer = pl.Trainer(
        max_epochs=args.epochs,
        precision=args.precision,
        gradient_clip_val=args.clip_val if args.task == "tags" else None,
        callbacks=[ModelCheckpoint(dirpath=args.out_dir, save_last=True), LearningRateMonitor("step")],
        default_root_dir=args.out_dir,
    )
    trainer.fit(module, datamodule=dm)


if __name__ == "__main__":
    main()
