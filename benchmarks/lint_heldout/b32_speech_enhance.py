"""Complex-mask speech enhancement in the STFT domain.

A Conv-TasNet style temporal convolutional network runs on log-magnitude
frames and predicts a complex ratio mask (DCCRN-E "E" variant: bounded
magnitude, free phase).  An auxiliary head predicts frame-level voice
activity.  Training: SI-SNR + multi-resolution STFT loss.
"""
import argparse
import os
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader

from enhance.data import NoisySpeechDataset


class STFTMixin:
    """Shared STFT front-end; the transforms always run in fp32."""

    n_fft: int
    hop: int

    def stft(self, wav):
        window = torch.hann_window(self.n_fft, device=wav.device)
        with torch.autocast("cuda", enabled=False):
            return torch.stft(wav.float(), self.n_fft, self.hop, window=window, return_complex=True)

    def istft(self, spec, length):
        window = torch.hann_window(self.n_fft, device=spec.device)
        return torch.istft(spec, self.n_fft, self.hop, window=window, length=length)


class GlobalLayerNorm(nn.Module):
    """gLN from Conv-TasNet: statistics over channels and time."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, y):
        mean = y.mean(dim=(1, 2), keepdim=True)  # expect: AMP004
        var = ((y - mean) ** 2).mean(dim=(1, 2), keepdim=True)
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta


class CumulativeLayerNorm(nn.Module):
    """cLN for the causal model: running statistics up to each frame."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, y):
        c, t = y.shape[1], y.shape[2]
        cum_sum = y.sum(dim=1, keepdim=True).cumsum(dim=2)
        cum_pow_sum = (y * y).sum(dim=1, keepdim=True).cumsum(dim=2)
        count = torch.arange(c, c * (t + 1), c, device=y.device, dtype=cum_sum.dtype).view(1, 1, -1)
        cum_mean = cum_sum / count
        cum_var = cum_pow_sum / count - cum_mean.pow(2)
        return self.gamma * (y - cum_mean) / torch.sqrt(cum_var + 1e-8) + self.beta


def make_norm(norm_type, channels):
    return GlobalLayerNorm(channels) if norm_type == "gLN" else CumulativeLayerNorm(channels)


def _standardize(x, dim):
    mu = x.mean(dim, keepdim=True)  # expect: AMP004
    sd = x.std(dim, keepdim=True)  # expect: AMP004
    return (x - mu) / (sd + 1e-5)


def normalize_features(x):
    """Per-frame feature standardisation before the mask estimator."""
    return _standardize(x, dim=-1)


class TCNBlock(nn.Module):
    def __init__(self, in_ch, hid_ch, kernel, dilation, norm_type="gLN", causal=False):
        super().__init__()
        pad = (kernel - 1) * dilation if causal else (kernel - 1) * dilation // 2
        self.conv1x1 = nn.Conv1d(in_ch, hid_ch, 1)
        self.norm1 = make_norm(norm_type, hid_ch)
        self.prelu1 = nn.PReLU()
        self.dconv = nn.Conv1d(hid_ch, hid_ch, kernel, padding=pad, dilation=dilation, groups=hid_ch)
        self.norm2 = make_norm(norm_type, hid_ch)
        self.prelu2 = nn.PReLU()
        self.res_out = nn.Conv1d(hid_ch, in_ch, 1)
        self.skip_out = nn.Conv1d(hid_ch, in_ch, 1)
        self.chomp = pad if causal else 0

    def forward(self, x):
        y = self.prelu1(self.norm1(self.conv1x1(x)))
        y = self.dconv(y)
        if self.chomp:
            y = y[..., : -self.chomp]
        y = self.prelu2(self.norm2(y))
        return x + self.res_out(y), self.skip_out(y)


class EnhancerBase(STFTMixin, nn.Module):
    def __init__(self, feat_dim, n_fft=512, hop=128):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.n_freq = n_fft // 2 + 1
        self.mask_proj = nn.Linear(feat_dim, 2 * self.n_freq)
        self.vad_head = nn.Linear(feat_dim, 1)

    def _forward_features(self, feat):
        raise NotImplementedError

    def forward(self, wav):
        spec = self.stft(wav)
        mag = spec.abs()
        z = self._forward_features(torch.log1p(mag))
        mask = self.mask_proj(z).transpose(1, 2)
        m_re = mask[:, : self.n_freq]
        m_im = mask[:, self.n_freq :]
        mask_mag = torch.sqrt(m_re * m_re + m_im * m_im)
        phase_re = m_re / (mask_mag + 1e-8)  # expect: AMP011
        phase_im = m_im / (mask_mag + 1e-8)  # expect: AMP011
        est_mag = torch.tanh(mask_mag) * mag
        est_phase = torch.angle(spec) + torch.atan2(phase_im, phase_re)
        with torch.autocast("cuda", enabled=False):
            est_spec = torch.polar(est_mag.float(), est_phase.float())
            est_wav = self.istft(est_spec, wav.shape[-1])
        return {"wav": est_wav, "mask_mag": mask_mag, "vad_logits": self.vad_head(z).squeeze(-1)}


class TCNEnhancer(EnhancerBase):
    def __init__(self, n_fft=512, hop=128, bottleneck=256, hidden=512, kernel=3, layers=8, repeats=3,
                 norm_type="gLN", causal=False):
        super().__init__(bottleneck, n_fft, hop)
        self.bottleneck = nn.Conv1d(self.n_freq, bottleneck, 1)
        self.bottleneck_norm = GlobalLayerNorm(bottleneck)
        self.tcn = nn.ModuleList(
            [TCNBlock(bottleneck, hidden, kernel, 2 ** i, norm_type, causal) for _ in range(repeats) for i in range(layers)]
        )
        self.skip_proj = nn.Conv1d(bottleneck, bottleneck, 1)

    def _forward_features(self, feat):
        x = self.bottleneck_norm(self.bottleneck(feat))
        skip_sum = 0.0
        for block in self.tcn:
            x, skip = block(x)
            skip_sum = skip_sum + skip
        return normalize_features(self.skip_proj(skip_sum).transpose(1, 2))


def build_enhancer(mcfg):
    return TCNEnhancer(**mcfg)


class SISNRLoss(nn.Module):
    def forward(self, est, ref):
        est = est - est.mean(dim=-1, keepdim=True)
        ref = ref - ref.mean(dim=-1, keepdim=True)
        proj = (est * ref).sum(dim=-1, keepdim=True) * ref / (ref.pow(2).sum(dim=-1, keepdim=True) + 1e-8)
        noise = est - proj
        ratio = proj.pow(2).sum(dim=-1) / (noise.pow(2).sum(dim=-1) + 1e-8)
        return -10.0 * torch.log10(ratio + 1e-8).mean()


class MultiResSTFTLoss(nn.Module):
    def __init__(self, fft_sizes=(512, 1024, 2048), hops=(128, 256, 512)):
        super().__init__()
        self.fft_sizes, self.hops = fft_sizes, hops

    def forward(self, est, ref):
        total = 0.0
        for n_fft, hop in zip(self.fft_sizes, self.hops):
            window = torch.hann_window(n_fft, device=est.device)
            e = torch.stft(est.float(), n_fft, hop, window=window, return_complex=True).abs()
            r = torch.stft(ref.float(), n_fft, hop, window=window, return_complex=True).abs()
            sc = torch.linalg.norm(r - e) / (torch.linalg.norm(r) + 1e-8)
            total = total + sc + F.l1_loss(torch.log(e + 1e-8), torch.log(r + 1e-8))
        return total / len(self.fft_sizes)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    sisnr, n = 0.0, 0
    for noisy, clean, _ in loader:
        noisy, clean = noisy.to(device), clean.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(noisy)
        sisnr += -SISNRLoss()(out["wav"].float(), clean).item()
        n += 1
    model.train()
    return sisnr / max(n, 1)


def train(cfg):
    device = torch.device("cuda")
    model = build_enhancer(cfg["model"])
    model.to(device)
    model.half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["optim"]["lr"])  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    amp_ctx = partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    sisnr_loss, stft_loss = SISNRLoss(), MultiResSTFTLoss()
    train_loader = DataLoader(NoisySpeechDataset(cfg["data"]["train"], segment=4.0), batch_size=cfg["batch_size"],
                              shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(NoisySpeechDataset(cfg["data"]["val"], segment=None), batch_size=1)
    best = -1e9
    for epoch in range(cfg["epochs"]):
        for noisy, clean, vad in train_loader:
            noisy, clean, vad = noisy.to(device), clean.to(device), vad.to(device)
            with amp_ctx():
                out = model(noisy)
                loss = sisnr_loss(out["wav"], clean) + cfg["stft_weight"] * stft_loss(out["wav"], clean)
            with torch.autocast("cuda", enabled=False):
                vad_loss = F.binary_cross_entropy(torch.sigmoid(out["vad_logits"].float()), vad.float())
            loss = loss + cfg["vad_weight"] * vad_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
        score = validate(model, val_loader, device)
        scheduler.step(score)
        if score > best:
            best = score
            torch.save({"model": model.state_dict(), "epoch": epoch, "sisnr": score},
                       os.path.join(cfg["out_dir"], "best.pt"))
        print(f"epoch {epoch}: val SI-SNR {score:.2f} dB (best {best:.2f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    args = parser.parse_args()
    with open(args.config) as f:
        train(yaml.safe_load(f))
