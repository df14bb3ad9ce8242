"""HiFi-GAN vocoder training with a multi-resolution STFT auxiliary loss.

    python train_vocoder.py --config configs/v1.json --checkpoint-dir ckpt/v1
"""
import argparse
import itertools
import json
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import weight_norm, remove_weight_norm
from torch.utils.data import DataLoader

from meldataset import MelDataset, mel_spectrogram
from models import Generator, MultiPeriodDiscriminator, MultiScaleDiscriminator
from utils import AttrDict, scan_checkpoint, load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)

def make_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        # torch < 2.3
        return torch.cuda.amp.GradScaler(enabled=enabled)


def stft_magnitude(x, fft_size, hop_size, win_length, window):
    spec = torch.stft(x.float(), fft_size, hop_size, win_length, window.to(x.device), return_complex=True)
    return torch.sqrt(torch.clamp(spec.real ** 2 + spec.imag ** 2, min=1e-7)).transpose(2, 1)


class SpectralConvergenceLoss(nn.Module):
    def forward(self, x_mag, y_mag):
        return torch.norm(y_mag - x_mag, p="fro") / torch.norm(y_mag, p="fro")


class LogSTFTMagnitudeLoss(nn.Module):
    def forward(self, x_mag, y_mag):
        return F.l1_loss(torch.log(y_mag), torch.log(x_mag))


class STFTLoss(nn.Module):
    def __init__(self, fft_size=1024, shift_size=120, win_length=600):
        super().__init__()
        self.fft_size = fft_size
        self.shift_size = shift_size
        self.win_length = win_length
        self.register_buffer("window", torch.hann_window(win_length))
        self.spectral_convergence = SpectralConvergenceLoss()
        self.log_stft_magnitude = LogSTFTMagnitudeLoss()

    def forward(self, x, y):
        x_mag = stft_magnitude(x, self.fft_size, self.shift_size, self.win_length, self.window)
        y_mag = stft_magnitude(y, self.fft_size, self.shift_size, self.win_length, self.window)
        return self.spectral_convergence(x_mag, y_mag), self.log_stft_magnitude(x_mag, y_mag)


class MultiResolutionSTFTLoss(nn.Module):
    def __init__(self, fft_sizes=(1024, 2048, 512), hop_sizes=(120, 240, 50), win_lengths=(600, 1200, 240)):
        super().__init__()
        self.stft_losses = nn.ModuleList(
            [STFTLoss(fs, ss, wl) for fs, ss, wl in zip(fft_sizes, hop_sizes, win_lengths)]
        )

    def forward(self, x, y):
        x = x.float()
        y = y.float()
        sc_loss, mag_loss = 0.0, 0.0
        for f in self.stft_losses:
            sc_l, mag_l = f(x, y)
            sc_loss += sc_l
            mag_loss += mag_l
        return sc_loss / len(self.stft_losses), mag_loss / len(self.stft_losses)


def feature_loss(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += torch.mean(torch.abs(rl - gl))
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
    gen_losses = []
    for dg in disc_outputs:
        l = torch.mean((1 - dg) ** 2)
        gen_losses.append(l)
        loss += l
    return loss, gen_losses


def train(rank, a, h):
    device = torch.device(f"cuda:{rank}")
    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)
    stft_criterion = MultiResolutionSTFTLoss().to(device)

    steps, last_epoch = 0, -1
    if os.path.isdir(a.checkpoint_path):
        cp_g = scan_checkpoint(a.checkpoint_path, "g_")
        cp_do = scan_checkpoint(a.checkpoint_path, "do_")
        if cp_g is not None and cp_do is not None:
            generator.load_state_dict(load_checkpoint(cp_g, device)["generator"])
            state_dict_do = load_checkpoint(cp_do, device)
            mpd.load_state_dict(state_dict_do["mpd"])
            msd.load_state_dict(state_dict_do["msd"])
            steps = state_dict_do["steps"] + 1
            last_epoch = state_dict_do["epoch"]

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()),
                                h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)
    scaler = make_scaler(a.fp16)

    trainset = MelDataset(a.input_training_file, h.segment_size, h.n_fft, h.num_mels, h.hop_size,
                          h.win_size, h.sampling_rate, h.fmin, h.fmax, shuffle=True, device=device)
    train_loader = DataLoader(trainset, num_workers=h.num_workers, shuffle=True,
                              batch_size=h.batch_size, pin_memory=True, drop_last=True)

    generator.train()
    mpd.train()
    msd.train()
    for epoch in range(max(0, last_epoch), a.training_epochs):
        for i, batch in enumerate(train_loader):
            x, y, _, y_mel = batch
            x = x.to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
            y = y.to(device, non_blocking=True).unsqueeze(1)
            y_mel = y_mel.to(device, non_blocking=True)

            with torch.autocast("cuda", dtype=torch.float16, enabled=a.fp16):
                y_g_hat = generator(x)
                y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1).float(), h.n_fft, h.num_mels, h.sampling_rate,
                                              h.hop_size, h.win_size, h.fmin, h.fmax_for_loss)

            # discriminators
            optim_d.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=a.fp16):
                y_df_hat_r, y_df_hat_g, _, _ = mpd(y, y_g_hat.detach())
                loss_disc_f = discriminator_loss(y_df_hat_r, y_df_hat_g)
                y_ds_hat_r, y_ds_hat_g, _, _ = msd(y, y_g_hat.detach())
                loss_disc_s = discriminator_loss(y_ds_hat_r, y_ds_hat_g)
                loss_disc_all = loss_disc_s + loss_disc_f
                scaler.scale(loss_disc_all).backward()  # expect: AMP008
            scaler.unscale_(optim_d)
            d_norm = torch.nn.utils.clip_grad_norm_(
                itertools.chain(mpd.parameters(), msd.parameters()), h.grad_clip)
            scaler.step(optim_d)

            # generator
            optim_g.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=a.fp16):
                loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
                sc_loss, mag_loss = stft_criterion(y_g_hat.squeeze(1), y.squeeze(1))
                y_df_hat_r, y_df_hat_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
                y_ds_hat_r, y_ds_hat_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
                loss_fm_s = feature_loss(fmap_s_r, fmap_s_g)
                loss_gen_s, _ = generator_loss(y_ds_hat_g)
            loss_fm_f = feature_loss(fmap_f_r, fmap_f_g)  # expect: AMP002
            loss_gen_f, losses_gen_f = generator_loss(y_df_hat_g)  # expect: AMP002
            loss_gen_all = (loss_gen_s + loss_gen_f + loss_fm_s + loss_fm_f + loss_mel
                            + h.stft_weight * (sc_loss + mag_loss))
            scaler.scale(loss_gen_all).backward()
            scaler.unscale_(optim_g)
            g_norm = torch.nn.utils.clip_grad_norm_(generator.parameters(), h.grad_clip)
            scaler.step(optim_g)
            scaler.update()

            if rank == 0 and steps % a.stdout_interval == 0:
                log.info("step %d gen %.3f mel %.3f sc %.3f mag %.3f |g| %.2f |d| %.2f",
                         steps, loss_gen_all.item(), loss_mel.item() / 45, sc_loss.item(),
                         mag_loss.item(), g_norm.item(), d_norm.item())
            if rank == 0 and steps % a.checkpoint_interval == 0 and steps != 0:
                save_checkpoint(f"{a.checkpoint_path}/g_{steps:08d}", {"generator": generator.state_dict()})
                save_checkpoint(f"{a.checkpoint_path}/do_{steps:08d}",
                                {"mpd": mpd.state_dict(), "msd": msd.state_dict(),
                                 "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                 "steps": steps, "epoch": epoch})
            steps += 1
        scheduler_g.step()
        scheduler_d.step()


def finetune_on_speaker(generator, loader, h, device, max_steps=2000):
    """Adapt a pretrained generator to one speaker with mel + STFT loss only."""
    stft_criterion = MultiResolutionSTFTLoss().to(device)
    optim = torch.optim.AdamW(generator.parameters(), lr=h.finetune_lr, betas=(0.8, 0.99))
    generator.train()
    for step, (x, y, _, y_mel) in enumerate(loader):
        x, y, y_mel = x.to(device), y.to(device), y_mel.to(device)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            y_g_hat = generator(x)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1).float(), h.n_fft, h.num_mels, h.sampling_rate,
                                          h.hop_size, h.win_size, h.fmin, h.fmax_for_loss)
            sc_loss, mag_loss = stft_criterion(y_g_hat.squeeze(1), y)
            loss = F.l1_loss(y_mel, y_g_hat_mel) * 45 + sc_loss + mag_loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(generator.parameters(), h.grad_clip)
        optim.step()
        if step >= max_steps:
            break
    return generator


@torch.inference_mode()
def synthesize(generator, mels, device):
    generator.eval()
    for m in generator.modules():
        if hasattr(m, "weight_g"):
            remove_weight_norm(m)
    generator = generator.half()
    wavs = []
    for mel in mels:
        audio = generator(mel.to(device).half()).squeeze()
        audio = audio / audio.abs().max().clamp(min=1e-4) * 0.95
        wavs.append((audio.float() * 32767.0).short().cpu())
    return wavs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-training-file", default="LJSpeech-1.1/training.txt")
    parser.add_argument("--checkpoint-path", default="cp_hifigan")
    parser.add_argument("--config", default="config_v1.json")
    parser.add_argument("--training-epochs", type=int, default=3100)
    parser.add_argument("--stdout-interval", type=int, default=5)
    parser.add_argument("--checkpoint-interval", type=int, default=5000)
    parser.add_argument("--fp16", action="store_true")
    a = parser.parse_args()
    with open(a.config) as f:
        h = AttrDict(json.load(f))
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(h.seed)
    os.makedirs(a.checkpoint_path, exist_ok=True)
    train(0, a, h)


if __name__ == "__main__":
    main()
