"""HiFi-GAN vocoder: generator with multi-receptive-field fusion, multi-period and
multi-scale discriminators, feature matching and a multi-resolution STFT loss.

Trained with CUDA fp16 autocast and one GradScaler for both optimizers.
"""
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import weight_norm, spectral_norm

LRELU_SLOPE = 0.1


def get_padding(kernel_size, dilation=1):
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """Periodic activation x + sin^2(alpha x) / alpha (BigVGAN)."""

    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x):
        return x + 1.0 / (self.alpha + 1e-9) * torch.sin(self.alpha * x) ** 2


class ResBlock(nn.Module):
    def __init__(self, channels, kernel_size=3, dilations=(1, 3, 5)):
        super().__init__()
        self.convs1 = nn.ModuleList([
            weight_norm(nn.Conv1d(channels, channels, kernel_size, 1, dilation=d,
                                  padding=get_padding(kernel_size, d)))
            for d in dilations
        ])
        self.convs2 = nn.ModuleList([
            weight_norm(nn.Conv1d(channels, channels, kernel_size, 1, dilation=1,
                                  padding=get_padding(kernel_size, 1)))
            for _ in dilations
        ])

    def forward(self, x):
        for c1, c2 in zip(self.convs1, self.convs2):
            xt = c2(F.leaky_relu(c1(F.leaky_relu(x, LRELU_SLOPE)), LRELU_SLOPE))
            x = xt + x
        return x


class GlobalConditioner(nn.Module):
    """Utterance-level style vector from the mel spectrogram."""

    def __init__(self, n_mels, dim):
        super().__init__()
        self.conv = nn.Conv1d(n_mels, dim, 5, padding=2)
        self.proj = nn.Linear(dim, dim)

    def forward(self, mel):
        style = self.conv(mel).mean(dim=-1)  # expect: AMP004
        return self.proj(F.gelu(style))


class Generator(nn.Module):
    def __init__(self, n_mels=80, upsample_rates=(8, 8, 2, 2), upsample_kernels=(16, 16, 4, 4),
                 initial_channels=512, resblock_kernels=(3, 7, 11), peak_norm=True):
        super().__init__()
        self.num_kernels = len(resblock_kernels)
        self.peak_norm = peak_norm
        self.conv_pre = weight_norm(nn.Conv1d(n_mels, initial_channels, 7, 1, padding=3))
        self.cond = GlobalConditioner(n_mels, initial_channels)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        ch = initial_channels
        for u, k in zip(upsample_rates, upsample_kernels):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch, ch // 2, k, u, padding=(k - u) // 2)))
            ch //= 2
            for rk in resblock_kernels:
                self.resblocks.append(ResBlock(ch, rk))
        self.act_post = Snake(ch)
        self.conv_post = nn.Conv1d(ch, 1, 7, 1, padding=3)

    def forward(self, mel):
        x = self.conv_pre(mel) + self.cond(mel)[..., None]
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, LRELU_SLOPE))
            xs = None
            for j in range(self.num_kernels):
                r = self.resblocks[i * self.num_kernels + j](x)
                xs = r if xs is None else xs + r
            x = xs / self.num_kernels
        y = torch.tanh(self.conv_post(self.act_post(x)))
        if self.peak_norm:
            peak = y.abs().amax(dim=-1, keepdim=True)
            y = 0.95 * y / (peak + 1e-9)  # expect: AMP011
        return y


class DiscriminatorP(nn.Module):
    def __init__(self, period, kernel_size=5, stride=3):
        super().__init__()
        self.period = period
        chans = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList([
            weight_norm(nn.Conv2d(chans[i], chans[i + 1], (kernel_size, 1), (stride, 1),
                                  padding=(get_padding(kernel_size), 0)))
            for i in range(4)
        ])
        self.conv_post = weight_norm(nn.Conv2d(1024, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x):
        fmap = []
        b, c, t = x.shape
        if t % self.period != 0:
            n_pad = self.period - (t % self.period)
            x = F.pad(x, (0, n_pad), "reflect")
            t = t + n_pad
        x = x.view(b, c, t // self.period, self.period)
        for conv in self.convs:
            x = F.leaky_relu(conv(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class DiscriminatorS(nn.Module):
    def __init__(self, use_spectral_norm=False):
        super().__init__()
        norm = spectral_norm if use_spectral_norm else weight_norm
        self.convs = nn.ModuleList([
            norm(nn.Conv1d(1, 128, 15, 1, padding=7)),
            norm(nn.Conv1d(128, 256, 41, 4, groups=16, padding=20)),
            norm(nn.Conv1d(256, 512, 41, 4, groups=16, padding=20)),
            norm(nn.Conv1d(512, 1024, 5, 1, padding=2)),
        ])
        self.conv_post = norm(nn.Conv1d(1024, 1, 3, 1, padding=1))

    def forward(self, x):
        fmap = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class MultiDiscriminator(nn.Module):
    def __init__(self, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discs = nn.ModuleList([DiscriminatorP(p) for p in periods] +
                                   [DiscriminatorS(use_spectral_norm=True), DiscriminatorS()])

    def forward(self, y, y_hat):
        y_d_rs, y_d_gs, fmap_rs, fmap_gs = [], [], [], []
        for d in self.discs:
            y_d_r, fmap_r = d(y)
            y_d_g, fmap_g = d(y_hat)
            y_d_rs.append(y_d_r)
            fmap_rs.append(fmap_r)
            y_d_gs.append(y_d_g)
            fmap_gs.append(fmap_g)
        return y_d_rs, y_d_gs, fmap_rs, fmap_gs


class MultiResolutionSTFTLoss(nn.Module):
    def __init__(self, resolutions=((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))):
        super().__init__()
        self.resolutions = resolutions

    def forward(self, y_hat, y):
        sc_loss, mag_loss = 0.0, 0.0
        for n_fft, hop, win in self.resolutions:
            window = torch.hann_window(win, device=y.device)
            X = torch.stft(y_hat.float(), n_fft, hop, win, window, return_complex=True).abs()
            Y = torch.stft(y.float(), n_fft, hop, win, window, return_complex=True).abs()
            sc_loss = sc_loss + torch.norm(Y - X, p="fro") / (torch.norm(Y, p="fro") + 1e-8)
            mag_loss = mag_loss + F.l1_loss(torch.log(X.clamp(min=1e-7)), torch.log(Y.clamp(min=1e-7)))
        n = len(self.resolutions)
        return sc_loss / n, mag_loss / n


def feature_loss(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss = loss + torch.mean(torch.abs(rl - gl))  # expect: AMP004
    return loss * 2


def discriminator_loss(disc_real_outputs, disc_generated_outputs):
    loss = 0
    for dr, dg in zip(disc_real_outputs, disc_generated_outputs):
        loss = loss + torch.mean((1 - dr) ** 2) + torch.mean(dg ** 2)
    return loss


def generator_loss(disc_outputs):
    return sum(torch.mean((1 - dg) ** 2) for dg in disc_outputs)


def train(generator, mpd, loader, epochs=100, lr=2e-4, device="cuda"):
    generator.to(device).train()
    mpd.to(device).train()
    stft_loss = MultiResolutionSTFTLoss().to(device)
    optim_g = torch.optim.AdamW(generator.parameters(), lr, betas=(0.8, 0.99))
    optim_d = torch.optim.AdamW(mpd.parameters(), lr, betas=(0.8, 0.99))
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=0.999)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=0.999)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        for mel, y in loader:
            mel, y = mel.to(device, non_blocking=True), y.to(device, non_blocking=True).unsqueeze(1)

            with torch.autocast("cuda", dtype=torch.float16):
                y_g_hat = generator(mel)
                y_d_r, y_d_g, _, _ = mpd(y, y_g_hat.detach())
                loss_disc = discriminator_loss(y_d_r, y_d_g)
            optim_d.zero_grad(set_to_none=True)
            scaler.scale(loss_disc).backward()
            scaler.unscale_(optim_d)
            torch.nn.utils.clip_grad_norm_(mpd.parameters(), 1000.0)
            scaler.step(optim_d)

            with torch.autocast("cuda", dtype=torch.float16):
                y_d_r, y_d_g, fmap_r, fmap_g = mpd(y, y_g_hat)
                loss_fm = feature_loss(fmap_r, fmap_g)
                loss_adv = generator_loss(y_d_g)
                loss_rms = (y_g_hat.std(dim=-1) - y.std(dim=-1)).abs().mean()  # expect: AMP004
            sc, mag = stft_loss(y_g_hat.squeeze(1), y.squeeze(1))
            loss_wav = F.l1_loss(y_g_hat, y)  # expect: AMP002
            loss_gen = loss_adv + loss_fm + 45.0 * (sc + mag) + 10.0 * loss_wav + loss_rms
            optim_g.zero_grad(set_to_none=True)
            scaler.scale(loss_gen).backward()
            scaler.step(optim_g)
            scaler.update()
        sched_g.step()
        sched_d.step()
    return generator


def main(loader):
    generator = Generator()
    mpd = MultiDiscriminator()
    all_params = itertools.chain(generator.parameters(), mpd.parameters())
    print(f"{sum(p.numel() for p in all_params) / 1e6:.1f}M parameters")
    return train(generator, mpd, loader)
