"""Caption-conditioned DCGAN trained with Lightning manual optimization.

Usage:
    python lit_caption_gan.py --data-root /data/cub --precision 16-mixed --devices 2
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision

from gan_data import CaptionImageDataModule


class CaptionEncoder(nn.Module):
    """Small transformer over caption tokens; returns the [CLS] embedding."""

    def __init__(self, vocab_size, dim=256, heads=4, depth=2, max_len=64):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(depth)])
        self.qkv = nn.ModuleList([nn.Linear(dim, 3 * dim) for _ in range(depth)])
        self.proj = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(dim)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, tokens, pad_mask):
        b, t = tokens.shape
        x = self.tok(tokens) + self.pos[:, :t]
        for norm, qkv, proj in zip(self.norms, self.qkv, self.proj):
            q, k, v = qkv(norm(x)).chunk(3, dim=-1)
            q = q.view(b, t, self.heads, -1).transpose(1, 2)
            k = k.view(b, t, self.heads, -1).transpose(1, 2)
            v = v.view(b, t, self.heads, -1).transpose(1, 2)
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
            scores = scores.masked_fill(pad_mask[:, None, None, :], torch.finfo(scores.dtype).min)
            h = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
            x = x + proj(h)
        return self.final_norm(x[:, 0])


class Generator(nn.Module):
    def __init__(self, z_dim, text_dim, ngf=64):
        super().__init__()
        self.project = nn.Linear(z_dim + text_dim, ngf * 8 * 4 * 4)
        self.net = nn.Sequential(
            nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 3, 4, 2, 1), nn.Tanh(),
        )

    def forward(self, z, text_emb):
        h = self.project(torch.cat([z, text_emb], dim=1))
        return self.net(h.view(h.size(0), -1, 4, 4))


class Discriminator(nn.Module):
    def __init__(self, text_dim, ndf=64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True),
        )
        self.text_proj = nn.Linear(text_dim, 128)
        self.head = nn.Linear(ndf * 8 * 4 * 4 + 128, 1)

    def forward(self, img, text_emb):
        h = self.features(img).flatten(1)
        return self.head(torch.cat([h, self.text_proj(text_emb)], dim=1)).squeeze(1)


class CaptionGAN(pl.LightningModule):
    def __init__(self, vocab_size, z_dim=128, text_dim=256, lr_g=2e-4, lr_d=2e-4,
                 r1_gamma=1.0, r1_every=4, ema_decay=0.999, clip_val=1.0):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.text_encoder = CaptionEncoder(vocab_size, dim=text_dim)
        self.generator = Generator(z_dim, text_dim)
        self.discriminator = Discriminator(text_dim)
        self.generator_ema = copy.deepcopy(self.generator).requires_grad_(False)

    def r1_penalty(self, real, text_emb):
        with torch.cuda.amp.autocast(enabled=False):  # expect: AMP009
            real = real.detach().float().requires_grad_(True)
            logits = self.discriminator(real, text_emb.detach().float())
            (grad,) = torch.autograd.grad(logits.sum(), real, create_graph=True)
        return grad.pow(2).flatten(1).sum(1).mean()

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        images, tokens, pad_mask = batch
        images = images.half()  # expect: AMP001
        text_emb = self.text_encoder(tokens, pad_mask)
        z = torch.randn(images.size(0), self.hparams.z_dim, device=self.device, dtype=text_emb.dtype)

        # discriminator update
        self.toggle_optimizer(opt_d)
        fake = self.generator(z, text_emb.detach())
        real_logits = self.discriminator(images, text_emb.detach())
        fake_logits = self.discriminator(fake.detach(), text_emb.detach())
        d_loss = (F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits))
                  + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits)))
        if batch_idx % self.hparams.r1_every == 0:
            r1 = self.r1_penalty(images, text_emb)
            d_loss = d_loss + 0.5 * self.hparams.r1_gamma * self.hparams.r1_every * r1
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=self.hparams.clip_val, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        # generator + caption encoder update
        self.toggle_optimizer(opt_g)
        gen_logits = self.discriminator(self.generator(z, text_emb), text_emb)
        g_loss = F.binary_cross_entropy_with_logits(gen_logits, torch.ones_like(gen_logits))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=self.hparams.clip_val, gradient_clip_algorithm="norm")
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.log_dict({"loss/d": d_loss.detach(), "loss/g": g_loss.detach()}, prog_bar=True)

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_idx):
        decay = self.hparams.ema_decay
        for p_ema, p in zip(self.generator_ema.parameters(), self.generator.parameters()):
            p_ema.lerp_(p.detach(), 1.0 - decay)
        for b_ema, b in zip(self.generator_ema.buffers(), self.generator.buffers()):
            b_ema.copy_(b)

    def configure_optimizers(self):
        g_params = list(self.generator.parameters()) + list(self.text_encoder.parameters())
        opt_g = torch.optim.Adam(g_params, lr=self.hparams.lr_g, betas=(0.0, 0.99))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr_d, betas=(0.0, 0.99))
        return [opt_g, opt_d]


def export_generator(ckpt_path, out_path):
    module = CaptionGAN.load_from_checkpoint(ckpt_path, map_location="cpu")
    generator = copy.deepcopy(module.generator_ema).half().eval()
    torch.save({"generator": generator.state_dict(),
                "text_encoder": module.text_encoder.half().state_dict()}, out_path)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--precision", default="16-mixed", choices=["32-true", "16-mixed", "bf16-mixed"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--resume", default=None)
    p.add_argument("--export", default=None, help="write a serving checkpoint from --resume and exit")
    return p.parse_args()


def main():
    args = parse_args()
    if args.export:
        export_generator(args.resume, args.export)
        return

    dm = CaptionImageDataModule(args.data_root, batch_size=args.batch_size, image_size=64)
    dm.setup("fit")
    model = CaptionGAN(vocab_size=dm.vocab_size)

    precision = args.precision
    plugins = []
    if args.precision == "16-mixed":
        plugins.append(MixedPrecision("16-mixed", "cuda", scaler=torch.cuda.amp.GradScaler(init_scale=2.0 ** 12)))  # expect: AMP009
        precision = None

    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision=precision,
        plugins=plugins,
        callbacks=[ModelCheckpoint(every_n_train_steps=5000, save_last=True), LearningRateMonitor()],
        log_every_n_steps=50,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
