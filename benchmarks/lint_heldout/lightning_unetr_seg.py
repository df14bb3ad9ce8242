"""3D organ segmentation with a small UNETR-like network (Lightning)."""
import argparse
import copy

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from data import AbdomenCTDataModule  # project-local


class _MemoryEfficientSwish(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        sx = torch.sigmoid(x)
        return grad_output * (sx * (1 + x * (1 - sx)))


class _SoftDice(torch.autograd.Function):
    """Soft Dice loss over (B, C, D, H, W); always evaluated in fp32."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, probs, target, smooth):
        dims = (2, 3, 4)
        inter = (probs * target).sum(dims)
        denom = probs.sum(dims) + target.sum(dims) + smooth
        ctx.save_for_backward(target, inter, denom)
        ctx.smooth = smooth
        return 1.0 - ((2 * inter + smooth) / denom).mean()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        target, inter, denom = ctx.saved_tensors
        n = inter.numel()
        g = (2 * target * denom[..., None, None, None] - (2 * inter + ctx.smooth)[..., None, None, None]) / denom[..., None, None, None] ** 2
        return -grad_out * g / n, None, None


class Swish(nn.Module):
    def forward(self, x):
        return _MemoryEfficientSwish.apply(x)


class TokenAttention(nn.Module):
    def __init__(self, dim, num_heads=8):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, keep=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if keep is not None:
            # drop background patches from the keys
            attn[~keep[:, None, None, :].expand_as(attn)] = -1e9  # expect: AMP007
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class UNETRLite(nn.Module):
    def __init__(self, in_ch=1, n_classes=4, dim=384, patch=16, depth=6):
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv3d(in_ch, dim, kernel_size=patch, stride=patch)
        self.blocks = nn.ModuleList([TokenAttention(dim) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(depth)])
        self.decoder = nn.Sequential(
            nn.ConvTranspose3d(dim, 128, 2, 2), nn.InstanceNorm3d(128), Swish(),
            nn.ConvTranspose3d(128, 64, 2, 2), nn.InstanceNorm3d(64), Swish(),
            nn.ConvTranspose3d(64, 32, 4, 4), nn.InstanceNorm3d(32), Swish(),
            nn.Conv3d(32, n_classes, 1),
        )

    def forward(self, x, keep=None):
        tokens = self.embed(x)
        B, C, D, H, W = tokens.shape
        t = tokens.flatten(2).transpose(1, 2)
        for norm, blk in zip(self.norms, self.blocks):
            t = t + blk(norm(t), keep)
        return self.decoder(t.transpose(1, 2).reshape(B, C, D, H, W))


class SegModule(pl.LightningModule):
    def __init__(self, n_classes=4, lr=1e-4, weight_decay=1e-5, smooth=1e-5):
        super().__init__()
        self.save_hyperparameters()
        self.net = UNETRLite(n_classes=n_classes)

    def forward(self, x):
        return self.net(x)

    def _loss(self, logits, target):
        ce = F.binary_cross_entropy_with_logits(logits, target)
        dice = _SoftDice.apply(torch.sigmoid(logits), target, self.hparams.smooth)
        return ce + dice

    def training_step(self, batch, batch_idx):
        logits = self(batch["image"])
        loss = self._loss(logits, batch["label"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["image"])
        self.log("val/loss", self._loss(logits, batch["label"]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return torch.sigmoid(self(batch["image"].half())) > 0.5

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, eps=1e-8)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_epochs)
        return {"optimizer": opt, "lr_scheduler": sched}

    def on_save_checkpoint(self, checkpoint):
        # small fp16 copy for the viewer plugin
        checkpoint["state_dict_fp16"] = {k: v.half() for k, v in self.state_dict().items() if v.is_floating_point()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=300)
    args = parser.parse_args()
    dm = AbdomenCTDataModule(args.data, batch_size=2, roi=(96, 96, 96))
    model = SegModule()
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="gpu", devices=1, precision="16-mixed",
                         gradient_clip_val=1.0, callbacks=[ModelCheckpoint(monitor="val/loss")])
    trainer.fit(model, datamodule=dm)
    export = copy.deepcopy(model.net).half().eval()
    torch.save(export.state_dict(), "unetr_fp16.pt")


if __name__ == "__main__":
    main()
