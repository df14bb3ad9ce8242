"""Complex-mask speech enhancement in the STFT domain with a Conv-TasNet style
TCN separator (gLN / cLN normalisation), plus the trainer used for the
DNS-challenge experiments.

The STFT / iSTFT are always evaluated in fp32; only the mask estimator runs
under autocast.
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data.dns import NoisySpeechDataset, collate_fixed_length
from utils.audio import pesq_batch, stoi_batch
from utils.logging import setup_logger, TensorboardWriter

logger = logging.getLogger(__name__)


@dataclass
class EnhConfig:
    n_fft: int = 512
    hop: int = 128
    N: int = 256          # encoder channels
    B: int = 128          # bottleneck channels
    H: int = 256          # conv-block channels
    P: int = 3            # depthwise kernel
    X: int = 8            # blocks per repeat
    R: int = 3            # repeats
    norm_type: str = "gLN"
    mask_type: str = "E"  # E: DCCRN polar mask, CB: bounded complex ratio mask
    lr: float = 1e-3
    weight_decay: float = 1e-5
    clip_grad_norm: float = 5.0
    amp: bool = True
    epochs: int = 100
    batch_size: int = 16
    segment_sec: float = 4.0
    loss_weights: dict = field(default_factory=lambda: {"sisnr": 1.0, "mag": 10.0})


# --------------------------------------------------------------------------- #
# normalisation layers (Luo & Mesgarani, Conv-TasNet)
# --------------------------------------------------------------------------- #
class ChannelwiseLayerNorm(nn.Module):
    """Channel-wise Layer Normalization (cLN)"""

    def __init__(self, channel_size):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channel_size, 1))
        self.beta = nn.Parameter(torch.zeros(1, channel_size, 1))

    def forward(self, y):
        # y: [M, N, K]
        mean = torch.mean(y, dim=1, keepdim=True)  # expect: AMP004
        var = torch.var(y, dim=1, keepdim=True, unbiased=False)  # expect: AMP004
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta  # expect: AMP011


class GlobalLayerNorm(nn.Module):
    """Global Layer Normalization (gLN)"""

    def __init__(self, channel_size):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channel_size, 1))
        self.beta = nn.Parameter(torch.zeros(1, channel_size, 1))

    def forward(self, y):
        mean = y.mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)  # expect: AMP004
        var = (torch.pow(y - mean, 2)).mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta


def chose_norm(norm_type, channel_size):
    if norm_type == "gLN":
        return GlobalLayerNorm(channel_size)
    elif norm_type == "cLN":
        return ChannelwiseLayerNorm(channel_size)
    elif norm_type == "BN":
        return nn.BatchNorm1d(channel_size)
    raise ValueError(f"unsupported norm type {norm_type}")


# --------------------------------------------------------------------------- #
# separator
# --------------------------------------------------------------------------- #
class TemporalBlock(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, dilation, norm_type):
        super().__init__()
        padding = (kernel_size - 1) * dilation // 2
        self.conv1x1 = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        self.norm1 = chose_norm(norm_type, out_channels)
        self.prelu1 = nn.PReLU()
        self.dsconv = nn.Conv1d(out_channels, out_channels, kernel_size, padding=padding,
                                dilation=dilation, groups=out_channels, bias=False)
        self.norm2 = chose_norm(norm_type, out_channels)
        self.prelu2 = nn.PReLU()
        self.pointwise = nn.Conv1d(out_channels, in_channels, 1, bias=False)

    def forward(self, x):
        residual = x
        y = self.prelu1(self.norm1(self.conv1x1(x)))
        y = self.prelu2(self.norm2(self.dsconv(y)))
        return self.pointwise(y) + residual


class EnhOutput(NamedTuple):
    est_wav: torch.Tensor
    est_mag: torch.Tensor
    mask_real: torch.Tensor
    mask_imag: torch.Tensor


class ComplexMaskTCN(nn.Module):
    def __init__(self, cfg: EnhConfig):
        super().__init__()
        self.cfg = cfg
        n_freq = cfg.n_fft // 2 + 1
        self.register_buffer("window", torch.hann_window(cfg.n_fft), persistent=False)
        self.encoder = nn.Conv1d(n_freq, cfg.N, 1)
        self.input_norm = ChannelwiseLayerNorm(cfg.N)
        self.bottleneck = nn.Conv1d(cfg.N, cfg.B, 1)
        blocks = []
        for _ in range(cfg.R):
            for x in range(cfg.X):
                blocks.append(TemporalBlock(cfg.B, cfg.H, cfg.P, dilation=2 ** x, norm_type=cfg.norm_type))
        self.blocks = nn.ModuleList(blocks)
        self.mask_act = nn.PReLU()
        self.mask_conv = nn.Conv1d(cfg.B, 2 * n_freq, 1)

    def stft(self, wav):
        with torch.autocast("cuda", enabled=False):
            return torch.stft(wav.float(), self.cfg.n_fft, self.cfg.hop, window=self.window,
                              return_complex=True)

    def istft(self, spec, length):
        with torch.autocast("cuda", enabled=False):
            return torch.istft(spec, self.cfg.n_fft, self.cfg.hop, window=self.window, length=length)

    def forward(self, noisy):
        spec = self.stft(noisy)                       # [B, F, T] complex64
        spec_mag = spec.abs()
        feats = torch.log1p(spec_mag)

        w = F.relu(self.encoder(feats))
        h = self.bottleneck(self.input_norm(w))
        for block in self.blocks:
            h = block(h)
        mask_real, mask_imag = self.mask_conv(self.mask_act(h)).chunk(2, dim=1)

        if self.cfg.mask_type == "E":
            # DCCRN-E: magnitude through tanh, phase from the normalised mask
            mask_mags = (mask_real ** 2 + mask_imag ** 2) ** 0.5
            real_phase = mask_real / (mask_mags + 1e-8)
            imag_phase = mask_imag / (mask_mags + 1e-8)
            mask_phase = torch.atan2(imag_phase, real_phase)
            est_mag = torch.tanh(mask_mags) * spec_mag
            est_phase = torch.angle(spec) + mask_phase
            est_spec = torch.polar(est_mag.float(), est_phase.float())
        elif self.cfg.mask_type == "CB":
            # bounded complex ratio mask: |M| squashed by tanh, phase kept
            mag = torch.sqrt(mask_real * mask_real + mask_imag * mask_imag)
            scale = torch.tanh(mag) / (mag + 1e-8)  # expect: AMP011
            mask = torch.complex((mask_real * scale).float(), (mask_imag * scale).float())
            est_spec = mask * spec
            est_mag = est_spec.abs()
        else:
            raise ValueError(self.cfg.mask_type)

        est_wav = self.istft(est_spec, noisy.shape[-1])
        return EnhOutput(est_wav=est_wav, est_mag=est_mag, mask_real=mask_real, mask_imag=mask_imag)


# --------------------------------------------------------------------------- #
# losses
# --------------------------------------------------------------------------- #
def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(dim=-1, keepdim=True)
    ref = ref - ref.mean(dim=-1, keepdim=True)
    proj = (est * ref).sum(dim=-1, keepdim=True) * ref / (ref.pow(2).sum(dim=-1, keepdim=True) + eps)
    noise = est - proj
    ratio = proj.pow(2).sum(dim=-1) / (noise.pow(2).sum(dim=-1) + eps)
    return 10 * torch.log10(ratio + eps)


class EnhancementLoss(nn.Module):
    def __init__(self, weights, n_fft, hop):
        super().__init__()
        self.weights = weights
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def forward(self, out: EnhOutput, clean):
        loss_sisnr = -si_snr(out.est_wav, clean).mean()
        with torch.autocast("cuda", enabled=False):
            ref_mag = torch.stft(clean.float(), self.n_fft, self.hop, window=self.window, return_complex=True).abs()
            loss_mag = F.mse_loss(out.est_mag.float().pow(0.3), ref_mag.pow(0.3))
        total = self.weights["sisnr"] * loss_sisnr + self.weights["mag"] * loss_mag
        return total, {"sisnr": -loss_sisnr.detach(), "mag": loss_mag.detach()}


def build_model(cfg):
    return ComplexMaskTCN(cfg)


# --------------------------------------------------------------------------- #
# trainer
# --------------------------------------------------------------------------- #
class Trainer:
    """Single-GPU trainer. (The old torch.cuda.amp entry points are no longer used.)"""

    def __init__(self, cfg: EnhConfig, exp_dir, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.exp_dir = exp_dir
        self.model = build_model(cfg).to(device)
        self.criterion = EnhancementLoss(cfg.loss_weights, cfg.n_fft, cfg.hop).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, factor=0.5, patience=3)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)
        self.writer = TensorboardWriter(exp_dir)
        self.step = 0

    def train_step(self, noisy, clean):
        self.model.train()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            out = self.model(noisy)
            loss, parts = self.criterion(out, clean)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        grad_norm = None
        if self.cfg.clip_grad_norm > 0:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        return loss.item(), parts, grad_norm

    @torch.no_grad()
    def validate(self, loader):
        self.model.eval()
        tot, n, pesq_sum, stoi_sum = 0.0, 0, 0.0, 0.0
        for noisy, clean in loader:
            noisy, clean = noisy.to(self.device), clean.to(self.device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                out = self.model(noisy)
                loss, _ = self.criterion(out, clean)
            tot += loss.item() * noisy.shape[0]
            n += noisy.shape[0]
            est = out.est_wav.float().cpu().numpy()
            pesq_sum += pesq_batch(est, clean.cpu().numpy(), fs=16000).sum()
            stoi_sum += stoi_batch(est, clean.cpu().numpy(), fs=16000).sum()
        return tot / n, pesq_sum / n, stoi_sum / n

    def save(self, name, epoch):
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "epoch": epoch, "step": self.step},
                   os.path.join(self.exp_dir, name))

    def fit(self, train_loader, valid_loader):
        best = math.inf
        for epoch in range(self.cfg.epochs):
            for i, (noisy, clean) in enumerate(train_loader):
                loss, parts, gn = self.train_step(noisy.to(self.device), clean.to(self.device))
                if self.step % 100 == 0:
                    self.writer.add_scalar("train/loss", loss, self.step)
                    self.writer.add_scalar("train/sisnr", parts["sisnr"].item(), self.step)
                    if gn is not None:
                        self.writer.add_scalar("train/grad_norm", gn.item(), self.step)
                    self.writer.add_scalar("train/loss_scale", self.scaler.get_scale(), self.step)
            val_loss, pesq, stoi = self.validate(valid_loader)
            self.scheduler.step(val_loss)
            logger.info("epoch %d | valid loss %.4f | PESQ %.3f | STOI %.3f", epoch, val_loss, pesq, stoi)
            self.save("last.pth", epoch)
            if val_loss < best:
                best = val_loss
                self.save("best.pth", epoch)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_json", required=True)
    parser.add_argument("--valid_json", required=True)
    parser.add_argument("--exp_dir", default="exp/tcn_cmask")
    parser.add_argument("--norm_type", default="gLN", choices=["gLN", "cLN", "BN"])
    parser.add_argument("--mask_type", default="E", choices=["E", "CB"])
    parser.add_argument("--no_amp", action="store_true")
    args = parser.parse_args()

    cfg = EnhConfig(norm_type=args.norm_type, mask_type=args.mask_type, amp=not args.no_amp)
    os.makedirs(args.exp_dir, exist_ok=True)
    setup_logger(os.path.join(args.exp_dir, "train.log"))

    train_set = NoisySpeechDataset(args.train_json, segment=cfg.segment_sec)
    valid_set = NoisySpeechDataset(args.valid_json, segment=None)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=8,
                              collate_fn=collate_fixed_length, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=1, shuffle=False, num_workers=2)

    Trainer(cfg, args.exp_dir).fit(train_loader, valid_loader)


if __name__ == "__main__":
    main()
