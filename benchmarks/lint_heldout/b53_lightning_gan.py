"""Text-conditioned GAN (AttnGAN-lite) as a LightningModule with manual optimization.

Mixed precision is owned by Lightning (``Trainer(precision="16-mixed")``): the precision
plugin opens autocast around ``training_step`` and drives the GradScaler through
``self.manual_backward`` and the wrapped optimizers' ``step``. Gradient clipping goes
through ``self.clip_gradients`` so that it sees unscaled gradients.
"""
import copy
import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class _ScaledLeakyReLU(torch.autograd.Function):
    """Bias + leaky ReLU * sqrt(2) (StyleGAN's fused_bias_act reference), computed in fp32."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x, bias, negative_slope=0.2):
        y = x + bias.view(1, -1, *([1] * (x.ndim - 2)))
        ctx.save_for_backward(y)
        ctx.negative_slope = negative_slope
        return F.leaky_relu(y, negative_slope) * math.sqrt(2)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        (y,) = ctx.saved_tensors
        grad = grad_out * torch.where(y >= 0, 1.0, ctx.negative_slope) * math.sqrt(2)
        return grad, grad.sum(dim=[0] + list(range(2, grad.ndim))), None


class ScaledLeakyReLU(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        return _ScaledLeakyReLU.apply(x, self.bias)


class TextEncoder(nn.Module):
    def __init__(self, vocab_size=5000, dim=256, heads=4, layers=2, max_len=32):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.qkv = nn.ModuleList([nn.Linear(dim, dim * 3) for _ in range(layers)])
        self.proj = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(layers)])

    def forward(self, tokens):
        pad = tokens == 0
        h = self.tok(tokens) + self.pos[:, : tokens.shape[1]]
        B, T, D = h.shape
        for qkv, proj, norm in zip(self.qkv, self.proj, self.norms):
            q, k, v = qkv(norm(h)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.heads)
            scores = scores.masked_fill(pad[:, None, None, :], torch.finfo(scores.dtype).min)
            h = h + proj((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, D))
        words = h.masked_fill(pad[..., None], 0.0)
        sentence = words.float().sum(dim=1) / (~pad).sum(dim=1, keepdim=True).clamp(min=1)
        return words, sentence, ~pad


class Generator(nn.Module):
    def __init__(self, z_dim=128, text_dim=256, ch=256):
        super().__init__()
        self.ch = ch
        self.fc = nn.Linear(z_dim + text_dim, ch * 4 * 4)
        self.ups = nn.ModuleList()
        for _ in range(4):
            self.ups.append(nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch)))
        self.act = nn.ModuleList([ScaledLeakyReLU(ch) for _ in range(4)])
        self.word_proj = nn.Linear(text_dim, ch)
        self.to_rgb = nn.Conv2d(ch, 3, 3, padding=1)

    def attend_words(self, x, words, word_mask):
        B, C, H, W = x.shape
        query = x.flatten(2).transpose(1, 2)
        keys = self.word_proj(words)
        attn = query @ keys.transpose(1, 2) / math.sqrt(C)
        attn = attn.masked_fill(~word_mask[:, None, :], float("-inf"))
        context = attn.softmax(dim=-1) @ keys
        return x + context.transpose(1, 2).reshape(B, C, H, W)

    def forward(self, z, sentence, words, word_mask):
        x = self.fc(torch.cat([z, sentence], dim=1)).view(z.shape[0], self.ch, 4, 4)
        for i, (up, act) in enumerate(zip(self.ups, self.act)):
            x = act(up(x))
            if i == 2:
                x = self.attend_words(x, words, word_mask)
        return torch.tanh(self.to_rgb(x))


class Discriminator(nn.Module):
    def __init__(self, ch=128, text_dim=256):
        super().__init__()
        layers, c_in = [], 3
        for c_out in (ch, ch * 2, ch * 4, ch * 8):
            layers += [nn.Conv2d(c_in, c_out, 4, stride=2, padding=1), nn.LeakyReLU(0.2)]
            c_in = c_out
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(c_in * 4 * 4 + 1, 1)
        self.text_proj = nn.Linear(text_dim, c_in)

    def minibatch_std(self, x, group=4):
        g = min(group, x.shape[0])
        y = x.float().view(g, -1, *x.shape[1:])
        y = y.var(dim=0, unbiased=False).add(1e-8).sqrt().mean()
        return y.to(x.dtype).expand(x.shape[0], 1)

    def forward(self, img, sentence, words=None, word_mask=None):
        h = self.body(img)
        feats = h.flatten(1)
        logits = self.out(torch.cat([feats, self.minibatch_std(feats)], dim=1)).squeeze(1)
        pooled = h.flatten(2).transpose(1, 2)
        if words is not None:
            word_scores = pooled @ self.text_proj(words).transpose(1, 2)
            word_scores = word_scores.masked_fill(~word_mask[:, None, :], -65504.0).amax(dim=-1)
            logits = logits + 0.1 * word_scores.float().logsumexp(dim=-1)
        projection = (self.text_proj(sentence)[:, :, None] * h.flatten(2)).float().sum(dim=(1, 2))
        return logits.float() + projection


class TextGAN(pl.LightningModule):
    def __init__(self, z_dim=128, lr_g=2e-4, lr_d=2e-4, ema_decay=0.999, clip_val=10.0):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.text_encoder = TextEncoder().half()  # expect: AMP001
        self.generator = Generator(z_dim=z_dim)
        self.discriminator = Discriminator()
        self.generator_ema = copy.deepcopy(self.generator).eval().requires_grad_(False)

    def forward(self, tokens, z=None):
        words, sentence, mask = self.text_encoder(tokens)
        z = torch.randn(tokens.shape[0], self.hparams.z_dim, device=self.device) if z is None else z
        return self.generator_ema(z, sentence, words, mask)

    def training_step(self, batch, batch_idx):
        images, tokens = batch
        opt_g, opt_d = self.optimizers()
        words, sentence, mask = self.text_encoder(tokens)
        z = torch.randn(images.shape[0], self.hparams.z_dim, device=self.device)

        # discriminator: hinge loss on real / fake (+ mismatched text)
        self.toggle_optimizer(opt_d)
        fake = self.generator(z, sentence.detach(), words.detach(), mask).detach()
        d_real = self.discriminator(images, sentence.detach(), words.detach(), mask)
        d_fake = self.discriminator(fake, sentence.detach(), words.detach(), mask)
        d_wrong = self.discriminator(images, sentence.detach().roll(1, dims=0))
        loss_d = F.relu(1.0 - d_real.float()).mean() + 0.5 * (F.relu(1.0 + d_fake.float()).mean() + F.relu(1.0 + d_wrong.float()).mean())
        opt_d.zero_grad(set_to_none=True)
        self.manual_backward(loss_d)
        self.clip_gradients(opt_d, gradient_clip_val=self.hparams.clip_val, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        # generator (+ text encoder): non-saturating loss
        self.toggle_optimizer(opt_g)
        fake = self.generator(z, sentence, words, mask)
        d_out = self.discriminator(fake, sentence, words, mask)
        loss_g = F.binary_cross_entropy_with_logits(d_out, torch.ones_like(d_out))
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(loss_g)
        self.clip_gradients(opt_g, gradient_clip_val=self.hparams.clip_val, gradient_clip_algorithm="norm")
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.log_dict({"loss_d": loss_d.detach(), "loss_g": loss_g.detach()}, prog_bar=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p_ema, p in zip(self.generator_ema.parameters(), self.generator.parameters()):
                p_ema.lerp_(p.detach(), 1.0 - self.hparams.ema_decay)
            for b_ema, b in zip(self.generator_ema.buffers(), self.generator.buffers()):
                b_ema.copy_(b)

    def validation_step(self, batch, batch_idx):
        images, tokens = batch
        with torch.no_grad():
            samples = self(tokens)
        l1 = F.l1_loss(samples.float(), images.float())
        self.log("val/l1", l1, sync_dist=True)
        if batch_idx == 0:
            grid = ((samples[:16].float().clamp(-1, 1) + 1) / 2).cpu()
            self.logger.experiment.add_images("samples", grid, self.global_step)

    def configure_optimizers(self):
        g_params = list(self.generator.parameters()) + list(self.text_encoder.parameters())
        opt_g = torch.optim.Adam(g_params, lr=self.hparams.lr_g, betas=(0.0, 0.99), eps=1e-8)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr_d, betas=(0.0, 0.99), eps=1e-8)
        return opt_g, opt_d


def export_generator(module, path):
    gen = copy.deepcopy(module.generator_ema).half()
    text = copy.deepcopy(module.text_encoder).half().eval()
    torch.save({"generator": gen.state_dict(), "text_encoder": text.state_dict()}, path)


def main():
    model = TextGAN()
    trainer = pl.Trainer(max_epochs=100, accelerator="gpu", devices=1, precision="16-mixed", log_every_n_steps=50)
    trainer.fit(model, train_dataloaders=None, val_dataloaders=None)
    export_generator(model, "textgan_fp16.pt")


if __name__ == "__main__":
    main()
