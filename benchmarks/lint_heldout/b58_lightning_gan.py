"""StyleGAN-lite in PyTorch Lightning with manual optimization.

Two optimizers (generator, discriminator).  By default the run uses
``Trainer(precision="16-mixed")``: Lightning's precision plugin owns the
GradScaler, ``self.manual_backward`` scales the loss, ``opt.step()`` on the
LightningOptimizer unscales, steps and updates, and ``self.clip_gradients``
unscales before clipping.  ``--native-amp`` switches the trainer to fp32 and
the module does mixed precision itself (older versions of this file used
torch.cuda.amp.autocast and torch.cuda.amp.GradScaler for that).
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint


class ClampGrad(torch.autograd.Function):
    """Identity in forward, clamps the incoming gradient in backward."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x, bound):
        ctx.bound = bound
        return x.clone()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        return grad_output.clamp(-ctx.bound, ctx.bound), None


class PixelNorm(nn.Module):
    def forward(self, x):
        # pow runs in fp32 under CUDA autocast; the epsilon is added to an fp32 tensor
        return x * x.pow(2).mean(dim=1, keepdim=True).add(1e-8).rsqrt()


class SelfAttention2d(nn.Module):
    def __init__(self, channels, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Conv2d(channels, channels * 3, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x, keep=None):
        b, c, h, w = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, d, h * w).unbind(1)
        scores = torch.einsum("bhdn,bhdm->bhnm", q, k) / math.sqrt(d)
        if keep is not None:
            scores = scores.masked_fill(~keep[:, None, None, :], -1e9)  # expect: AMP007
        attn = scores.softmax(dim=-1)
        out = torch.einsum("bhnm,bhdm->bhdn", attn, v).reshape(b, c, h, w)
        return x + self.proj(out)


class NoiseInjection(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, channels, 1, 1))

    def forward(self, x):
        noise = torch.randn(x.size(0), 1, x.size(2), x.size(3), device=x.device, dtype=x.dtype)
        return x + self.weight * noise


class Generator(nn.Module):
    def __init__(self, latent_dim=128, base=256):
        super().__init__()
        self.mapping = nn.Sequential(PixelNorm(), nn.Linear(latent_dim, base), nn.LeakyReLU(0.2), nn.Linear(base, base))
        self.const = nn.Parameter(torch.randn(1, base, 4, 4))
        self.blocks = nn.ModuleList()
        ch = base
        for _ in range(3):
            self.blocks.append(nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(ch, ch // 2, 3, padding=1), NoiseInjection(ch // 2), nn.LeakyReLU(0.2)))
            ch //= 2
        self.attn = SelfAttention2d(ch)
        self.to_rgb = nn.Conv2d(ch, 3, 1)

    def forward(self, z, keep=None):
        style = self.mapping(z)
        x = self.const.expand(z.size(0), -1, -1, -1) + style[:, :, None, None]
        for block in self.blocks:
            x = block(x)
        x = self.attn(x, keep)
        return torch.tanh(self.to_rgb(x))


class MinibatchStdDev(nn.Module):
    def forward(self, x):
        # statistic computed in fp32, then matched back to the activations' dtype
        std = x.float().var(dim=0, unbiased=False).add(1e-8).sqrt().mean().to(x.dtype)
        return torch.cat([x, std.expand(x.size(0), 1, x.size(2), x.size(3))], dim=1)


class Discriminator(nn.Module):
    def __init__(self, base=64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, base, 3, padding=1), nn.LeakyReLU(0.2), nn.AvgPool2d(2),
            nn.Conv2d(base, base * 2, 3, padding=1), nn.LeakyReLU(0.2), nn.AvgPool2d(2),
        )
        self.mbstd = MinibatchStdDev()
        self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(256), nn.LeakyReLU(0.2), nn.Linear(256, 1))

    def forward(self, img, valid=None):
        out = self.mbstd(self.features(img))
        logits = self.head(out)
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None], -1e4)
        return logits


def adv_loss(logits, real: bool):
    target = torch.ones_like(logits) if real else torch.zeros_like(logits)
    return F.binary_cross_entropy_with_logits(logits, target)


class StyleGANLite(pl.LightningModule):
    def __init__(self, latent_dim=128, lr=2e-4, r1_gamma=10.0, r1_every=16, native_amp=False, clip_val=1.0):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()
        self.g_ema = copy.deepcopy(self.generator).requires_grad_(False)
        self.scaler = torch.amp.GradScaler("cuda", enabled=native_amp)

    def forward(self, z):
        return self.g_ema(z)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.size(0), self.hparams.latent_dim, device=self.device, dtype=real.dtype)
        if self.hparams.native_amp:
            self._native_amp_step(real, z, opt_g, opt_d, batch_idx)
            return

        # generator: the precision plugin scales in manual_backward and unscales in clip_gradients
        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = adv_loss(self.discriminator(fake), real=True)
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=self.hparams.clip_val, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        self.untoggle_optimizer(opt_g)

        # discriminator
        self.toggle_optimizer(opt_d)
        d_loss = adv_loss(self.discriminator(real), True) + adv_loss(self.discriminator(fake.detach()), False)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        self.untoggle_optimizer(opt_d)

        self.log_dict({"loss/g": g_loss.detach(), "loss/d": d_loss.detach()}, prog_bar=True)

    def _native_amp_step(self, real, z, opt_g, opt_d, batch_idx):
        with torch.autocast("cuda", dtype=torch.float16):
            fake = self.generator(z)
            g_loss = adv_loss(self.discriminator(fake), real=True)
        opt_g.zero_grad(set_to_none=True)
        self.scaler.scale(g_loss).backward()
        self.scaler.unscale_(opt_g)
        torch.nn.utils.clip_grad_norm_(self.generator.parameters(), self.hparams.clip_val)
        self.scaler.step(opt_g)

        with torch.autocast("cuda", dtype=torch.float16):
            d_loss = adv_loss(self.discriminator(real), True) + adv_loss(self.discriminator(fake.detach()), False)
        opt_d.zero_grad(set_to_none=True)
        self.scaler.scale(d_loss).backward()
        opt_d.step()  # expect: AMP006
        self.scaler.update()

        if batch_idx % self.hparams.r1_every == 0:
            self._r1_step(real, opt_d)
        self.log_dict({"loss/g": g_loss.detach(), "loss/d": d_loss.detach(), "amp/scale": self.scaler.get_scale()})

    def _r1_step(self, real, opt_d):
        real = real.detach().requires_grad_(True)
        logits = self.discriminator(real)
        (grad,) = torch.autograd.grad(logits.sum(), real, create_graph=True)
        penalty = grad.pow(2).flatten(1).sum(1).mean() * (self.hparams.r1_gamma / 2) * self.hparams.r1_every
        opt_d.zero_grad(set_to_none=True)
        self.scaler.scale(penalty).backward()
        torch.nn.utils.clip_grad_norm_(self.discriminator.parameters(), 10.0)  # expect: AMP005
        self.scaler.step(opt_d)
        self.scaler.update()

    def validation_step(self, batch, batch_idx):
        real, _ = batch
        z = torch.randn(real.size(0), self.hparams.latent_dim, device=self.device)
        with torch.autocast("cuda", dtype=torch.float16):
            fake = self.g_ema(z)
            score = self.discriminator(fake)
        self.log("val/d_fake", score.float().mean())

    def configure_optimizers(self):
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.0, 0.99), eps=1e-8)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.0, 0.99), eps=1e-8)
        return [opt_g, opt_d]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p_ema, p in zip(self.g_ema.parameters(), self.generator.parameters()):
                p_ema.lerp_(p, 1.0 - 0.999)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["g_ema_fp16"] = {k: v.half() for k, v in self.g_ema.state_dict().items()}


class GradNormLogger(Callback):
    """Lightning calls on_before_optimizer_step after the precision plugin unscaled."""

    def __init__(self, max_norm=None):
        self.max_norm = max_norm
        self.best_fid = 1e9

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params]))
        pl_module.log("grad_norm", norm)

    def on_validation_epoch_end(self, trainer, pl_module):
        fid = trainer.callback_metrics.get("val/fid")
        if fid is not None and fid < self.best_fid:
            self.best_fid = float(fid)


class SampleExporter(Callback):
    def __init__(self, every_n_epochs=5):
        self.every_n_epochs = every_n_epochs

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch % self.every_n_epochs:
            return
        with torch.inference_mode():
            z = torch.randn(16, pl_module.hparams.latent_dim, device=pl_module.device)
            samples = pl_module.g_ema(z).half().cpu()
        trainer.logger.log_image("samples", [samples.float()])

    def on_train_end(self, trainer, pl_module):
        export_model = copy.deepcopy(pl_module.g_ema).half().eval()
        torch.save(export_model.state_dict(), "g_ema_fp16.pt")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--native-amp", action="store_true")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    precision = "32-true" if args.native_amp else "16-mixed"
    model = StyleGANLite(native_amp=args.native_amp)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="gpu",
        devices=1,
        precision=precision,
        callbacks=[GradNormLogger(), SampleExporter(), LearningRateMonitor(), ModelCheckpoint(save_last=True)],
        log_every_n_steps=50,
    )
    from torchvision.datasets import CIFAR10
    import torchvision.transforms as T

    ds = CIFAR10("data", download=True, transform=T.Compose([T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)]))
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
