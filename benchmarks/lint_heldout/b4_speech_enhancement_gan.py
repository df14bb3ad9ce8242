"""Speech-enhancement GAN (SEGAN/MetricGAN-like): conv generator, sigmoid discriminator, mel-domain losses, fp16 AMP."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio


class Generator(nn.Module):
    def __init__(self, ch=(1, 16, 32, 64, 128, 256)):
        super().__init__()
        self.enc = nn.ModuleList([nn.Conv1d(ch[i], ch[i + 1], 31, stride=2, padding=15) for i in range(len(ch) - 1)])
        self.dec = nn.ModuleList(
            [nn.ConvTranspose1d(ch[i + 1] * 2, ch[i], 32, stride=2, padding=15) for i in reversed(range(len(ch) - 1))]
        )
        self.act = nn.PReLU()

    def forward(self, x):
        x = x.unsqueeze(1)
        skips = []
        for conv in self.enc:
            x = self.act(conv(x))
            skips.append(x)
        for deconv, skip in zip(self.dec, reversed(skips)):
            x = deconv(torch.cat([x, skip], dim=1))
            x = torch.tanh(x) if deconv is self.dec[-1] else self.act(x)
        return x.squeeze(1)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, 32, 31, 4, 15), nn.LeakyReLU(0.2), nn.Conv1d(32, 64, 31, 4, 15), nn.LeakyReLU(0.2),
            nn.Conv1d(64, 128, 31, 4, 15), nn.LeakyReLU(0.2), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(128, 1),
            nn.Sigmoid(),
        )

    def forward(self, wav):
        return self.net(wav.unsqueeze(1))


def stft_mag(wav, n_fft=512, hop=128):
    window = torch.hann_window(n_fft, device=wav.device)
    return torch.stft(wav.float(), n_fft, hop, window=window, return_complex=True).abs()


def prepare_batch(batch, device):
    noisy, clean = batch
    return noisy.to(device, torch.float16), clean.to(device, torch.float16)  # expect: AMP001


def pretrain_generator(generator, loader, epochs=5, lr=2e-4, device="cuda"):
    optimizer = torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.5, 0.999))
    generator.train()
    for _ in range(epochs):
        for noisy, clean in loader:
            noisy, clean = noisy.to(device), clean.to(device)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.l1_loss(generator(noisy), clean)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return generator


def train_gan(cfg, generator, discriminator, loader, device="cuda"):
    mel_basis = torchaudio.functional.melscale_fbanks(257, 0.0, 8000.0, 80, 16000).T.to(device)
    opt_g = torch.optim.Adam(generator.parameters(), lr=cfg.lr_g, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=cfg.lr_d, betas=(0.5, 0.999))
    bce = nn.BCELoss()
    scaler = torch.amp.GradScaler("cuda")

    for epoch in range(cfg.epochs):
        for it, batch in enumerate(loader):
            noisy, clean = prepare_batch(batch, device)
            with torch.autocast("cuda", dtype=torch.float16):
                enhanced = generator(noisy)

            # discriminator
            opt_d.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                d_real = discriminator(clean)
                d_fake = discriminator(enhanced.detach())
                loss_d = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))  # expect: AMP003
                scaler.scale(loss_d).backward()  # expect: AMP008
            scaler.unscale_(opt_d)
            torch.nn.utils.clip_grad_norm_(discriminator.parameters(), 10.0)
            scaler.step(opt_d)

            # generator
            opt_g.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                mel_hat = torch.matmul(mel_basis, stft_mag(enhanced))
                mel_clean = torch.matmul(mel_basis, stft_mag(clean))
                log_mel_hat = torch.log(mel_hat + 1e-9)  # expect: AMP011
                log_mel_clean = torch.log(torch.clamp(mel_clean, min=1e-5))
                energy_hat = mel_hat.mean(dim=1)  # expect: AMP004
                energy_clean = mel_clean.float().mean(dim=1)
                loss_mel = F.l1_loss(log_mel_hat, log_mel_clean) + 0.1 * F.l1_loss(energy_hat, energy_clean)
                adv = torch.mean((discriminator(enhanced) - 1.0) ** 2)
            loss_wav = F.l1_loss(enhanced, clean)  # expect: AMP002
            loss_g = cfg.lambda_adv * adv + cfg.lambda_mel * loss_mel + cfg.lambda_wav * loss_wav
            scaler.scale(loss_g).backward()
            torch.nn.utils.clip_grad_norm_(generator.parameters(), 10.0)  # expect: AMP005
            scaler.step(opt_g)
            scaler.update()

            if it % 100 == 0:
                print(f"epoch {epoch} it {it} D {loss_d.item():.3f} G {loss_g.item():.3f} scale {scaler.get_scale():.0f}")
    return generator


@torch.inference_mode()
def enhance_file(generator, wav_path, out_path, device="cuda"):
    wav, sr = torchaudio.load(wav_path)
    g = generator.eval().half()
    out = g(wav.to(device).half()).float().cpu()
    torchaudio.save(out_path, out, sr)
