"""Spectrogram U-Net that separates a mixture into sources with bounded complex masks.

The STFT and iSTFT run in fp32 outside the network; the U-Net runs under CUDA fp16
autocast with a GradScaler, gradient accumulation and an EMA copy for validation.
"""
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SepConfig:
    n_src: int = 4
    n_fft: int = 2048
    hop: int = 512
    base: int = 32
    depth: int = 5
    use_se: bool = True
    lr: float = 3e-4
    accum_steps: int = 4
    clip: float = 5.0
    mask_reg: float = 1e-3
    ema_decay: float = 0.999
    epochs: int = 100


@dataclass
class SeparationOutput:
    est_spec: torch.Tensor   # (B, S, F, T) complex
    mask_reg: torch.Tensor


def make_grad_scaler():
    try:
        return torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):  # torch < 2.3
        return torch.cuda.amp.GradScaler()


class SqueezeExcite(nn.Module):
    def __init__(self, c, r=8):
        super().__init__()
        self.fc1 = nn.Linear(c, max(c // r, 4))
        self.fc2 = nn.Linear(max(c // r, 4), c)

    def forward(self, x):
        s = x.mean(dim=(2, 3))  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s[:, :, None, None]


class GlobalLayerNorm(nn.Module):
    """gLN from Conv-TasNet, over channels, frequency and time."""

    def __init__(self, c):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, c, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, x):
        mean = x.mean(dim=(1, 2, 3), keepdim=True)  # expect: AMP004
        var = ((x - mean) ** 2).mean(dim=(1, 2, 3), keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + 1e-8) + self.beta


class EncoderBlock(nn.Module):
    def __init__(self, c_in, c_out, use_se):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.se = SqueezeExcite(c_out) if use_se else nn.Identity()
        self.down = nn.Conv2d(c_out, c_out, kernel_size=(2, 1), stride=(2, 1))

    def forward(self, x):
        h = F.gelu(self.norm1(self.conv1(x)))
        h = self.se(self.conv2(h))
        return self.down(h), h


class DecoderBlock(nn.Module):
    def __init__(self, c_in, c_out, use_se):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, kernel_size=(2, 1), stride=(2, 1))
        self.conv1 = nn.Conv2d(2 * c_out, c_out, 3, padding=1)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.se = SqueezeExcite(c_out) if use_se else nn.Identity()

    def forward(self, x, skip):
        h = torch.cat([self.up(x), skip], dim=1)
        h = F.gelu(self.norm1(self.conv1(h)))
        return self.se(self.conv2(h))


class ComplexMaskUNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        chans = [cfg.base * 2 ** i for i in range(cfg.depth)]
        self.n_src = cfg.n_src
        self.stem = nn.Conv2d(2, chans[0], 3, padding=1)
        self.enc = nn.ModuleList(
            [EncoderBlock(c_in, c_out, cfg.use_se) for c_in, c_out in zip([chans[0]] + chans[:-1], chans)])
        self.mid_conv = nn.Conv2d(chans[-1], chans[-1], 3, padding=1)
        self.mid_norm = GlobalLayerNorm(chans[-1])
        self.dec = nn.ModuleList(
            [DecoderBlock(c_in, c_out, cfg.use_se) for c_in, c_out in zip(chans[::-1], chans[::-1][1:] + [chans[0]])])
        self.out = nn.Conv2d(chans[0], 2 * cfg.n_src, kernel_size=1)

    def forward(self, spec):
        B, Fq, T = spec.shape
        feats = torch.stack([spec.real, spec.imag], dim=1)
        feats = feats / (feats.abs().amax(dim=(1, 2, 3), keepdim=True) + 1e-5)
        x = self.stem(feats)
        skips = []
        for blk in self.enc:
            x, skip = blk(x)
            skips.append(skip)
        x = F.gelu(self.mid_norm(self.mid_conv(x)))
        for blk, skip in zip(self.dec, reversed(skips)):
            x = blk(x, skip)
        m = self.out(x).view(B, self.n_src, 2, Fq, T)
        mr = m[:, :, 0]
        mi = m[:, :, 1]
        # bounded mask: magnitude squashed with tanh, phase kept
        mag = torch.sqrt(mr * mr + mi * mi + 1e-8)  # expect: AMP011
        scale = torch.tanh(mag) / (mag + 1e-8)  # expect: AMP011
        mr = mr * scale
        mi = mi * scale
        # fp16 mask times fp32 spectrogram: the estimate is fp32
        est_r = mr * spec.real[:, None] - mi * spec.imag[:, None]
        est_i = mr * spec.imag[:, None] + mi * spec.real[:, None]
        # pow runs in fp32 under CUDA autocast: this eps and mean are fine
        reg = torch.log(mr ** 2 + mi ** 2 + 1e-8).mean()
        return SeparationOutput(torch.complex(est_r, est_i), reg)


def neg_si_sdr(est, ref):
    est = est - est.mean(dim=-1, keepdim=True)
    ref = ref - ref.mean(dim=-1, keepdim=True)
    alpha = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + 1e-8)
    target = alpha * ref
    noise = est - target
    ratio = target.pow(2).sum(-1) / (noise.pow(2).sum(-1) + 1e-8)
    return -10.0 * torch.log10(ratio + 1e-8).mean()


class SeparationTrainer:
    def __init__(self, cfg, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.model = ComplexMaskUNet(cfg).to(device)
        self.ema = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=1e-2)
        self.scaler = make_grad_scaler()
        self.window = torch.hann_window(cfg.n_fft, device=device)

    def stft(self, wav):
        B, C, L = wav.shape
        spec = torch.stft(wav.reshape(B * C, L).float(), self.cfg.n_fft, self.cfg.hop,
                          window=self.window, return_complex=True)
        return spec.view(B, C, *spec.shape[-2:]).mean(dim=1)

    def istft(self, spec, length):
        B, S, Fq, T = spec.shape
        wav = torch.istft(spec.reshape(B * S, Fq, T), self.cfg.n_fft, self.cfg.hop,
                          window=self.window, length=length)
        return wav.view(B, S, length)

    @torch.no_grad()
    def update_ema(self):
        for p_ema, p in zip(self.ema.parameters(), self.model.parameters()):
            p_ema.lerp_(p, 1.0 - self.cfg.ema_decay)

    def train_epoch(self, loader):
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        for i, (mixture, sources) in enumerate(loader):
            mixture = mixture.to(self.device, non_blocking=True)
            sources = sources.to(self.device, non_blocking=True).mean(dim=2)  # mono targets
            spec = self.stft(mixture)
            with torch.autocast("cuda", dtype=torch.float16):
                out = self.model(spec)
                est = self.istft(out.est_spec, mixture.shape[-1])
                loss = neg_si_sdr(est, sources) + self.cfg.mask_reg * out.mask_reg
            self.scaler.scale(loss / self.cfg.accum_steps).backward()
            if (i + 1) % self.cfg.accum_steps == 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)  # expect: AMP005
                self.scaler.step(self.opt)
                self.scaler.update()
                self.opt.zero_grad(set_to_none=True)
                self.update_ema()

    @torch.no_grad()
    def validate(self, loader):
        scores = []
        for mixture, sources in loader:
            mixture = mixture.to(self.device)
            sources = sources.to(self.device).mean(dim=2)
            with torch.autocast("cuda", dtype=torch.float16):
                out = self.ema(self.stft(mixture))
                est = self.istft(out.est_spec, mixture.shape[-1])
                scores.append(-neg_si_sdr(est, sources).item())
        return sum(scores) / max(len(scores), 1)


def main(cfg, train_loader, val_loader, out_path):
    trainer = SeparationTrainer(cfg)
    best = -math.inf
    for epoch in range(cfg.epochs):
        trainer.train_epoch(train_loader)
        sdr = trainer.validate(val_loader)
        print(f"epoch {epoch}: SI-SDR {sdr:.2f} dB")
        if sdr > best:
            best = sdr
            torch.save(trainer.ema.state_dict(), out_path)
