"""Speech enhancement GAN (SEGAN-like): generator on noisy waveforms, waveform discriminator."""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio

SAMPLE_RATE = 16000
HALF = torch.half


def stft_mag(x, n_fft=512, hop=128):
    window = torch.hann_window(n_fft, device=x.device)
    return torch.stft(x.float(), n_fft, hop, window=window, return_complex=True).abs()


def multi_resolution_stft_loss(pred, target):
    loss = 0.0
    for n_fft, hop in ((512, 128), (1024, 256), (2048, 512)):
        p, t = stft_mag(pred, n_fft, hop), stft_mag(target, n_fft, hop)
        loss = loss + (t - p).norm() / t.norm() + F.l1_loss(p.log1p(), t.log1p())
    return loss / 3


def train(generator, discriminator, loader, args):
    device = torch.device("cuda")
    generator = generator.to(device).to(HALF)  # expect: AMP001
    discriminator = discriminator.to(device)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4, betas=(0.5, 0.9))  # expect: AMP011
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-4, betas=(0.5, 0.9))
    for epoch in range(args.epochs):
        for noisy, clean in loader:
            noisy = noisy.to(device).to(HALF)  # expect: AMP001
            clean = clean.to(device)
            enhanced = generator(noisy).float()
            d_real = discriminator(clean)
            d_fake = discriminator(enhanced.detach())
            d_loss = 0.5 * ((d_real - 1) ** 2).mean() + 0.5 * (d_fake ** 2).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = 0.5 * ((discriminator(enhanced) - 1) ** 2).mean() + 100 * F.l1_loss(enhanced, clean)
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
        torch.save(generator.state_dict(), os.path.join(args.out, f"g_{epoch}.pt"))


def train_amp(generator, discriminator, loader, args):
    device = torch.device("cuda")
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for noisy, clean in loader:
        noisy, clean = noisy.to(device), clean.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            enhanced = generator(noisy)
            d_fake = discriminator(enhanced.detach())
            d_real = discriminator(clean)
            d_loss = F.mse_loss(d_real, torch.ones_like(d_real)) + F.mse_loss(d_fake, torch.zeros_like(d_fake))
        opt_d.zero_grad()
        scaler.scale(d_loss).backward()
        scaler.step(opt_d)
        with torch.autocast("cuda", dtype=torch.float16):
            g_adv = F.mse_loss(discriminator(enhanced), torch.ones_like(d_fake))
        g_stft = multi_resolution_stft_loss(enhanced, clean)
        opt_g.zero_grad()
        scaler.scale(g_adv + g_stft).backward()
        scaler.step(opt_g)
        scaler.update()


@torch.inference_mode()
def enhance_file(generator, path, out_path):
    wav, sr = torchaudio.load(path)
    wav = torchaudio.functional.resample(wav, sr, SAMPLE_RATE).cuda().half()
    enhanced = generator.half()(wav[None]).float().cpu()
    torchaudio.save(out_path, enhanced[0], SAMPLE_RATE)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=86)
    parser.add_argument("--out", default="ckpt")
    parser.parse_args()
