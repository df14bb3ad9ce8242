"""HiFi-GAN (V1) vocoder with speaker-adaptive upsampling, Snake activations, multi-period
and multi-scale discriminators; fp16 autocast with one GradScaler for both optimizers (VITS)."""
import copy
import itertools
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from librosa.filters import mel as librosa_mel_fn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader

from meldataset import MelDataset  # noqa: E402  (project-local: crops audio, returns mel, audio, speaker id)

LRELU_SLOPE = 0.1
mel_basis = {}
hann_window = {}


def get_padding(kernel_size, dilation=1):
    return (kernel_size * dilation - dilation) // 2


def apply_weight_norm(module):
    """ParallelWaveGAN style: wrap every conv once the module is built."""
    def _apply(m):
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.ConvTranspose1d)):
            weight_norm(m)
    module.apply(_apply)


class Snake(nn.Module):
    """BigVGAN periodic activation: x + 1/alpha * sin^2(alpha * x)."""
    def __init__(self, channels, alpha=1.0):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1, channels, 1), alpha))

    def forward(self, x):
        return x + (1.0 / (self.alpha + 1e-9)) * torch.sin(x * self.alpha) ** 2


class AdaIN1d(nn.Module):
    """Speaker-conditioned instance norm applied after every upsampling layer."""
    def __init__(self, channels, style_dim):
        super().__init__()
        self.style = nn.Linear(style_dim, 2 * channels)

    def forward(self, x, s):
        gamma, beta = self.style(s).chunk(2, dim=1)
        mu = x.mean(dim=-1, keepdim=True)  # expect: AMP004
        sigma = x.std(dim=-1, keepdim=True)  # expect: AMP004
        h = (x - mu) / (sigma + 1e-8)  # expect: AMP011
        return (1.0 + gamma.unsqueeze(-1)) * h + beta.unsqueeze(-1)


class MRFBlock(nn.Module):
    def __init__(self, channels, kernel_size=3, dilation=(1, 3, 5)):
        super().__init__()
        self.convs1 = nn.ModuleList([nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                               padding=get_padding(kernel_size, d)) for d in dilation])
        self.convs2 = nn.ModuleList([nn.Conv1d(channels, channels, kernel_size, padding=get_padding(kernel_size))
                                     for _ in dilation])
        self.acts1 = nn.ModuleList([Snake(channels) for _ in dilation])
        self.acts2 = nn.ModuleList([Snake(channels) for _ in dilation])

    def forward(self, x):
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.acts1, self.acts2):
            x = x + c2(a2(c1(a1(x))))
        return x


class Generator(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.num_kernels = len(h["resblock_kernel_sizes"])
        self.num_upsamples = len(h["upsample_rates"])
        ch = h["upsample_initial_channel"]
        self.spk_embed = nn.Embedding(h["n_speakers"], h["spk_dim"])
        self.conv_pre = nn.Conv1d(h["num_mels"], ch, 7, 1, padding=3)
        self.ups = nn.ModuleList()
        self.adains = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (u, k) in enumerate(zip(h["upsample_rates"], h["upsample_kernel_sizes"])):
            c_out = ch // (2 ** (i + 1))
            self.ups.append(nn.ConvTranspose1d(c_out * 2, c_out, k, u, padding=(k - u) // 2))
            self.adains.append(AdaIN1d(c_out, h["spk_dim"]))
            for rk, rd in zip(h["resblock_kernel_sizes"], h["resblock_dilation_sizes"]):
                self.resblocks.append(MRFBlock(c_out, rk, rd))
        self.conv_post = nn.Conv1d(c_out, 1, 7, 1, padding=3)
        apply_weight_norm(self)

    def forward(self, mel, sid):
        spk = self.spk_embed(sid)
        x = self.conv_pre(mel)
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, LRELU_SLOPE)
            x = self.ups[i](x)
            x = self.adains[i](x, spk)
            xs = sum(self.resblocks[i * self.num_kernels + j](x) for j in range(self.num_kernels))
            x = xs / self.num_kernels
        x = F.leaky_relu(x)
        return torch.tanh(self.conv_post(x))


class FmapDiscriminator(nn.Module):
    """Shared forward of the sub-discriminators: every activation is kept for feature matching."""
    def _prepare(self, x):
        return x

    def forward(self, x):
        x = self._prepare(x)
        fmap = []
        for layer in self.convs:
            x = F.leaky_relu(layer(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class DiscriminatorP(FmapDiscriminator):
    def __init__(self, period, kernel_size=5, stride=3):
        super().__init__()
        self.period = period
        chans = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList([nn.Conv2d(cin, cout, (kernel_size, 1), (stride, 1), padding=(2, 0))
                                    for cin, cout in zip(chans[:-1], chans[1:])])
        self.convs.append(nn.Conv2d(1024, 1024, (kernel_size, 1), 1, padding=(2, 0)))
        self.conv_post = nn.Conv2d(1024, 1, (3, 1), 1, padding=(1, 0))
        apply_weight_norm(self)

    def _prepare(self, x):
        b, c, t = x.shape
        if t % self.period != 0:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
        return x.view(b, c, -1, self.period)


class DiscriminatorS(FmapDiscriminator):
    def __init__(self):
        super().__init__()
        specs = [(1, 128, 15, 1, 1), (128, 128, 41, 2, 4), (128, 256, 41, 2, 16),
                 (256, 512, 41, 4, 16), (512, 1024, 41, 4, 16), (1024, 1024, 5, 1, 1)]
        self.convs = nn.ModuleList([nn.Conv1d(cin, cout, k, s, groups=g, padding=k // 2) for cin, cout, k, s, g in specs])
        self.conv_post = nn.Conv1d(1024, 1, 3, 1, padding=1)
        apply_weight_norm(self)


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discriminators = nn.ModuleList([DiscriminatorP(p) for p in periods])

    def forward(self, y, y_hat):
        y_d_rs, y_d_gs, fmap_rs, fmap_gs = [], [], [], []
        for d in self.discriminators:
            y_d_r, fmap_r = d(y)
            y_d_g, fmap_g = d(y_hat)
            y_d_rs.append(y_d_r)
            fmap_rs.append(fmap_r)
            y_d_gs.append(y_d_g)
            fmap_gs.append(fmap_g)
        return y_d_rs, y_d_gs, fmap_rs, fmap_gs


class MultiScaleDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.discriminators = nn.ModuleList([DiscriminatorS() for _ in range(3)])
        self.meanpools = nn.ModuleList([nn.AvgPool1d(4, 2, padding=2), nn.AvgPool1d(4, 2, padding=2)])

    def forward(self, y, y_hat):
        y_d_rs, y_d_gs, fmap_rs, fmap_gs = [], [], [], []
        for i, d in enumerate(self.discriminators):
            if i != 0:
                y = self.meanpools[i - 1](y)
                y_hat = self.meanpools[i - 1](y_hat)
            y_d_r, fmap_r = d(y)
            y_d_g, fmap_g = d(y_hat)
            y_d_rs.append(y_d_r)
            fmap_rs.append(fmap_r)
            y_d_gs.append(y_d_g)
            fmap_gs.append(fmap_g)
        return y_d_rs, y_d_gs, fmap_rs, fmap_gs


def feature_loss(fmap_r, fmap_g, relative=False):
    """L1 feature matching; relative=True divides by the real features' mean magnitude."""
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            rl = rl.detach()
            term = torch.mean(torch.abs(rl - gl))  # expect: AMP004
            if relative:
                scale = torch.mean(torch.abs(rl))  # expect: AMP004
                term = term / (scale + 1e-8)  # expect: AMP011
            loss += term
    return loss * 2


def discriminator_loss(disc_real_outputs, disc_generated_outputs):
    loss = 0
    for dr, dg in zip(disc_real_outputs, disc_generated_outputs):
        r_loss = torch.mean((1 - dr) ** 2)
        g_loss = torch.mean(dg ** 2)
        loss += r_loss + g_loss
    return loss


def generator_loss(disc_outputs):
    loss = 0
    for dg in disc_outputs:
        loss += torch.mean((1 - dg) ** 2)
    return loss


def mel_spectrogram(y, n_fft, num_mels, sampling_rate, hop_size, win_size, fmin, fmax, center=False):
    key = f"{fmax}_{y.device}"
    if key not in mel_basis:
        mel = librosa_mel_fn(sr=sampling_rate, n_fft=n_fft, n_mels=num_mels, fmin=fmin, fmax=fmax)
        mel_basis[key] = torch.from_numpy(mel).float().to(y.device)
        hann_window[str(y.device)] = torch.hann_window(win_size).to(y.device)
    y = F.pad(y.unsqueeze(1), ((n_fft - hop_size) // 2, (n_fft - hop_size) // 2), mode="reflect").squeeze(1)
    spec = torch.view_as_real(torch.stft(y, n_fft, hop_length=hop_size, win_length=win_size, window=hann_window[str(y.device)],
                                         center=center, normalized=False, onesided=True, return_complex=True))
    spec = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    spec = torch.matmul(mel_basis[key], spec)
    return torch.log(torch.clamp(spec, min=1e-5))


def export_for_inference(generator, path):
    g = copy.deepcopy(generator).eval().half()
    torch.save({"generator": g.state_dict()}, path)


def train(h):
    device = torch.device("cuda")
    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)
    betas = (h["adam_b1"], h["adam_b2"])
    optim_g = torch.optim.AdamW(generator.parameters(), h["learning_rate"], betas=betas)
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()), h["learning_rate"], betas=betas)
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h["lr_decay"])
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h["lr_decay"])
    scaler = torch.amp.GradScaler("cuda", enabled=h["fp16_run"])

    files = sorted(os.path.join(h["data_dir"], f) for f in os.listdir(h["data_dir"]))
    loader = DataLoader(MelDataset(files, h), batch_size=h["batch_size"], shuffle=True,
                        num_workers=4, drop_last=True, pin_memory=True)

    steps = 0
    for epoch in range(h["epochs"]):
        for mel, y, sid in loader:
            mel, y, sid = mel.to(device), y.to(device), sid.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=h["fp16_run"]):
                y_g_hat = generator(mel, sid)
                y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1).float(), h["n_fft"], h["num_mels"],
                                              h["sampling_rate"], h["hop_size"], h["win_size"],
                                              h["fmin"], h["fmax_for_loss"])
                y_df_r, y_df_g, _, _ = mpd(y, y_g_hat.detach())
                y_ds_r, y_ds_g, _, _ = msd(y, y_g_hat.detach())
                loss_disc_all = discriminator_loss(y_df_r, y_df_g) + discriminator_loss(y_ds_r, y_ds_g)

            optim_d.zero_grad(set_to_none=True)
            scaler.scale(loss_disc_all).backward()
            grad_norm_d = torch.nn.utils.clip_grad_norm_(itertools.chain(mpd.parameters(), msd.parameters()), 1000.0)  # expect: AMP005
            scaler.step(optim_d)

            with torch.autocast("cuda", dtype=torch.float16, enabled=h["fp16_run"]):
                loss_mel = F.l1_loss(mel, y_g_hat_mel) * 45
                _, y_df_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
                _, y_ds_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
                loss_fm = (feature_loss(fmap_f_r, fmap_f_g, h["relative_fm"])
                           + feature_loss(fmap_s_r, fmap_s_g, h["relative_fm"]))
                loss_gen_all = generator_loss(y_df_g) + generator_loss(y_ds_g) + loss_fm + loss_mel

            optim_g.zero_grad(set_to_none=True)
            scaler.scale(loss_gen_all).backward()
            scaler.unscale_(optim_g)
            grad_norm_g = torch.nn.utils.clip_grad_norm_(generator.parameters(), 1000.0)
            scaler.step(optim_g)
            scaler.update()

            if steps % h["log_interval"] == 0:
                print(f"step {steps} gen {loss_gen_all.item():.3f} disc {loss_disc_all.item():.3f} "
                      f"mel {loss_mel.item() / 45:.3f} |g| {grad_norm_g:.2f} |d| {grad_norm_d:.2f}")
            steps += 1
        sched_g.step()
        sched_d.step()
    export_for_inference(generator, h["export_path"])


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        hparams = json.load(f)
    train(hparams)
