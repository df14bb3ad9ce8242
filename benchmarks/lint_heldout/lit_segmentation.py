"""Binary segmentation with PyTorch Lightning (precision set by the Trainer)."""
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics.classification import BinaryJaccardIndex


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


class TinyUNet(nn.Module):
    def __init__(self, channels=(32, 64, 128)):
        super().__init__()
        self.down = nn.ModuleList()
        cin = 3
        for c in channels:
            self.down.append(DoubleConv(cin, c))
            cin = c
        self.up = nn.ModuleList(
            [nn.ConvTranspose2d(c * 2 if i else c, c // 2, 2, stride=2) for i, c in enumerate(reversed(channels))]
        )
        self.head = nn.Conv2d(channels[0] // 2, 1, 1)

    def forward(self, x):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        for up, skip in zip(self.up, reversed(skips)):
            x = up(x)
            x = torch.cat([x, F.interpolate(skip, size=x.shape[-2:])], 1) if x.shape[1] != skip.shape[1] else x
        return self.head(x)


class SegModule(L.LightningModule):
    def __init__(self, lr: float = 1e-3, pos_weight: float = 3.0):
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyUNet()
        self.criterion = nn.BCELoss()
        self.iou = BinaryJaccardIndex()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        images, masks = batch
        with torch.autocast("cuda", dtype=torch.float16):
            probs = torch.sigmoid(self(images))
            loss = self.criterion(probs, masks.float())  # expect: AMP003
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, masks = batch
        logits = self(images)
        loss = F.binary_cross_entropy_with_logits(logits, masks.float(), pos_weight=torch.tensor(self.hparams.pos_weight))
        self.iou.update(logits.sigmoid(), masks.int())
        self.log("val/loss", loss, sync_dist=True)

    def on_validation_epoch_end(self):
        self.log("val/iou", self.iou.compute())
        self.iou.reset()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SegModuleFixed(SegModule):
    """The version after the CUDA 'unsafe to autocast' error: logits loss, precision from the Trainer."""

    def training_step(self, batch, batch_idx):
        images, masks = batch
        logits = self(images)
        loss = F.binary_cross_entropy_with_logits(logits, masks.float())
        dice = 1 - (2 * (logits.sigmoid() * masks).sum() + 1) / (logits.sigmoid().sum() + masks.sum() + 1)
        self.log_dict({"train/loss": loss, "train/dice": dice})
        return loss + dice

    def predict_step(self, batch, batch_idx):
        with torch.autocast("cuda", dtype=torch.float16):
            probs = torch.sigmoid(self(batch[0]))
        # BCE against the pseudo labels only for reporting; autocast is off here
        with torch.autocast("cuda", enabled=False):
            report = F.binary_cross_entropy(probs.float(), (probs > 0.5).float())
        return probs, report


def main():
    trainer = L.Trainer(max_epochs=50, precision="16-mixed", gradient_clip_val=1.0, devices=1)
    model = SegModuleFixed()
    trainer.fit(model)


if __name__ == "__main__":
    main()
