"""An image classifier as a LightningModule, trained with 16-bit mixed precision."""
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


class LitClassifier(L.LightningModule):
    def __init__(self, num_classes=10, lr=1e-3, label_smoothing=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = torchvision.models.resnet18(num_classes=num_classes)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def forward(self, x):
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        images = images.to(torch.float16)  # expect: AMP001
        logits = self(images)
        loss = self.criterion(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        acc = (logits.argmax(dim=-1) == labels).float().mean()
        self.log_dict({"val/loss": loss, "val/acc": acc}, prog_bar=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        images = batch[0].half()
        return self(images).softmax(dim=-1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr,
                                                        total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LitGAN(L.LightningModule):
    """Manual optimisation: Lightning's precision plugin scales manual_backward."""

    def __init__(self, generator, discriminator, latent_dim=100):
        super().__init__()
        self.automatic_optimization = False
        self.generator = generator
        self.discriminator = discriminator
        self.latent_dim = latent_dim

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.size(0), self.latent_dim, device=self.device)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(real.size(0), 1, device=self.device))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_g.step()
        d_real = self.discriminator(real)
        d_fake = self.discriminator(fake.detach())
        d_loss = (F.softplus(-d_real) + F.softplus(d_fake)).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        return [opt_g, opt_d]


def main():
    model = LitClassifier()
    trainer = L.Trainer(max_epochs=30, precision="16-mixed", accelerator="gpu", devices=1,
                        gradient_clip_val=1.0)
    trainer.fit(model)
    trainer.save_checkpoint("final.ckpt")
    half_model = LitClassifier.load_from_checkpoint("final.ckpt").half()
    half_model.eval()
    torch.save(half_model.state_dict(), "classifier_fp16.pt")


if __name__ == "__main__":
    main()
