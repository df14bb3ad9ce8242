"""CNN audio tagger (AudioSet / FSD50K) with pluggable temporal pooling heads.

    python train_tagger.py --pooling att --frontend logmel --batch_size 32
"""
import argparse
import copy
import logging
import os
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from audioset.data import build_loaders, mixup_batch
from audioset.mel import mel_filterbank
from audioset.metrics import d_prime, mean_average_precision

logger = logging.getLogger("tagger")


# --------------------------------------------------------------------------- #
# front-ends
# --------------------------------------------------------------------------- #
class LogMelFrontend(nn.Module):
    def __init__(self, sr=32000, n_fft=1024, hop=320, n_mels=64, fmin=50, fmax=14000):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        fb = mel_filterbank(sr, n_fft, n_mels, fmin, fmax)                  # n_mels x (n_fft//2+1)
        self.register_buffer("mel_fb", torch.as_tensor(fb, dtype=torch.float32), persistent=False)

    def forward(self, wav):
        spec = torch.stft(wav, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = spec.abs() ** 2
        mel = torch.matmul(self.mel_fb, power)
        return torch.log(mel + 1e-10)  # expect: AMP011


class PCENFrontend(nn.Module):
    """Trainable per-channel energy normalisation (Wang et al. 2017)."""

    def __init__(self, sr=32000, n_fft=1024, hop=320, n_mels=64, fmin=50, fmax=14000, s=0.04):
        super().__init__()
        self.n_fft, self.hop, self.s = n_fft, hop, s
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        fb = mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
        self.register_buffer("mel_fb", torch.as_tensor(fb, dtype=torch.float32), persistent=False)
        self.log_alpha = nn.Parameter(torch.full((n_mels, 1), float(np.log(0.98))))
        self.log_delta = nn.Parameter(torch.full((n_mels, 1), float(np.log(2.0))))
        self.log_r = nn.Parameter(torch.full((n_mels, 1), float(np.log(0.5))))

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            spec = torch.stft(wav.float(), self.n_fft, self.hop, window=self.window, return_complex=True)
            mel = torch.matmul(self.mel_fb, spec.abs() ** 2)
            smooth = [mel[..., 0]]
            for t in range(1, mel.shape[-1]):
                smooth.append((1 - self.s) * smooth[-1] + self.s * mel[..., t])
            smooth = torch.stack(smooth, dim=-1)
            alpha, delta, r = self.log_alpha.exp(), self.log_delta.exp(), self.log_r.exp()
            return (mel / (smooth + 1e-6) ** alpha + delta) ** r - delta ** r


# --------------------------------------------------------------------------- #
# pooling heads: (B, D, T) -> clip-wise probabilities
# --------------------------------------------------------------------------- #
class AttentionPool(nn.Module):
    """PANNs AttBlock, with a padding mask for variable-length clips."""

    def __init__(self, d, n_classes):
        super().__init__()
        self.att = nn.Conv1d(d, n_classes, 1)
        self.cla = nn.Conv1d(d, n_classes, 1)

    def forward(self, x, mask=None):
        att = torch.clamp(self.att(x), -10, 10)
        if mask is not None:
            att = att.masked_fill(~mask[:, None, :], -1e9)  # expect: AMP007
        norm_att = torch.softmax(att, dim=-1)
        cla = torch.sigmoid(self.cla(x))
        return torch.sum(norm_att * cla, dim=2), norm_att


class StatsPool(nn.Module):
    """x-vector statistics pooling (training uses fixed-length crops, mask unused)."""

    def __init__(self, d, n_classes):
        super().__init__()
        self.fc = nn.Linear(2 * d, n_classes)

    def forward(self, x, mask=None):
        mean = x.mean(dim=-1)  # expect: AMP004
        var = x.var(dim=-1, unbiased=False)  # expect: AMP004
        std = torch.sqrt(var + 1e-10)  # expect: AMP011
        return torch.sigmoid(self.fc(torch.cat([mean, std], dim=-1))), None


class MeanMaxPool(nn.Module):
    def __init__(self, d, n_classes):
        super().__init__()
        self.fc = nn.Linear(d, n_classes)

    def forward(self, x, mask=None):
        x_max = x if mask is None else x.masked_fill(~mask[:, None, :], torch.finfo(x.dtype).min)
        x1, _ = torch.max(x_max, dim=2)
        x2 = torch.mean(x, dim=2)  # expect: AMP004
        return torch.sigmoid(self.fc(F.dropout(x1 + x2, 0.5, self.training))), None


class AttentiveStatsPool(nn.Module):
    """ECAPA-TDNN attentive statistics pooling."""

    def __init__(self, d, n_classes, bottleneck=128):
        super().__init__()
        self.attention = nn.Sequential(
            nn.Conv1d(d, bottleneck, kernel_size=1), nn.ReLU(), nn.BatchNorm1d(bottleneck), nn.Tanh(),
            nn.Conv1d(bottleneck, d, kernel_size=1), nn.Softmax(dim=2))
        self.fc = nn.Linear(2 * d, n_classes)

    def forward(self, x, mask=None):
        w = self.attention(x)
        mu = torch.sum(x * w, dim=2)
        sg = torch.sqrt((torch.sum((x ** 2) * w, dim=2) - mu ** 2).clamp(min=1e-5))
        return torch.sigmoid(self.fc(torch.cat([mu, sg], dim=1))), w


POOLING = {"att": AttentionPool, "stats": StatsPool, "meanmax": MeanMaxPool, "asp": AttentiveStatsPool}


# --------------------------------------------------------------------------- #
# backbone
# --------------------------------------------------------------------------- #
class ConvBlock(nn.Module):
    def __init__(self, in_ch, out_ch):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)

    def forward(self, x, pool_size=(2, 2)):
        x = F.relu_(self.bn1(self.conv1(x)))
        x = F.relu_(self.bn2(self.conv2(x)))
        return F.avg_pool2d(x, kernel_size=pool_size)


class TaggerOutput(NamedTuple):
    clipwise: torch.Tensor
    embedding: torch.Tensor
    frame_att: Optional[torch.Tensor]


class AudioTagger(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        fe_kwargs = dict(sr=cfg.sample_rate, n_fft=cfg.n_fft, hop=cfg.hop, n_mels=cfg.n_mels)
        self.frontend = LogMelFrontend(**fe_kwargs) if cfg.frontend == "logmel" else PCENFrontend(**fe_kwargs)
        self.hop = cfg.hop
        self.bn0 = nn.BatchNorm2d(cfg.n_mels)
        chans = [1] + list(cfg.channels)
        self.blocks = nn.ModuleList(ConvBlock(chans[i], chans[i + 1]) for i in range(len(cfg.channels)))
        self.time_stride = 2 ** len(cfg.channels)
        self.proj = nn.Conv1d(chans[-1], cfg.embed_dim, kernel_size=1)
        self.pool = POOLING[cfg.pooling](cfg.embed_dim, cfg.num_classes)

    def forward(self, wav, lengths=None):
        x = self.frontend(wav)                                  # B, M, T
        x = x.transpose(1, 2).unsqueeze(1)                      # B, 1, T, M
        x = self.bn0(x.transpose(1, 3)).transpose(1, 3)
        for block in self.blocks:
            x = F.dropout(block(x), p=0.2, training=self.training)
        x = F.adaptive_avg_pool2d(x, (x.shape[2], 1)).squeeze(-1)  # B, C, T'
        h = F.relu(self.proj(x))
        mask = None
        if lengths is not None:
            frames = (lengths // (self.hop * self.time_stride)).clamp(min=1)
            mask = torch.arange(h.shape[-1], device=h.device)[None, :] < frames[:, None]
        clipwise, att = self.pool(h, mask)
        return TaggerOutput(clipwise=clipwise, embedding=h, frame_att=att)


# --------------------------------------------------------------------------- #
# train / eval
# --------------------------------------------------------------------------- #
def train(model, loader, optimizer, scaler, scheduler, args, epoch):
    model.train()
    for it, batch in enumerate(loader):
        wav = batch["waveform"].cuda(non_blocking=True)
        target = batch["target"].cuda(non_blocking=True)
        lengths = batch["length"].cuda(non_blocking=True)
        wav = wav / (wav.abs().amax(dim=-1, keepdim=True) + 1e-8)
        if args.mixup > 0:
            wav, target = mixup_batch(wav, target, alpha=args.mixup)

        with torch.autocast("cuda", dtype=torch.float16):
            out = model(wav, lengths)
            loss = F.binary_cross_entropy(out.clipwise, target)  # expect: AMP003

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if it % args.log_every == 0:
            logger.info("epoch %d it %d loss %.5f |g| %.3f scale %.0f lr %.2e", epoch, it, loss.item(),
                        grad_norm.item(), scaler.get_scale(), scheduler.get_last_lr()[0])


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    preds, targets, losses = [], [], []
    for batch in loader:
        wav, target = batch["waveform"].cuda(), batch["target"].cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(wav, batch["length"].cuda())
        clipwise = out.clipwise.float()
        losses.append(F.binary_cross_entropy(clipwise, target).item())
        preds.append(clipwise.cpu().numpy())
        targets.append(target.cpu().numpy())
    preds, targets = np.concatenate(preds), np.concatenate(targets)
    mAP = mean_average_precision(targets, preds)
    return {"loss": float(np.mean(losses)), "mAP": mAP, "d_prime": d_prime(targets, preds)}


def export_onnx(model, path, seconds=10, sr=32000):
    net = copy.deepcopy(model).eval().half().cuda()
    dummy = torch.randn(1, seconds * sr, device="cuda", dtype=torch.float16)
    torch.onnx.export(net, (dummy,), path, input_names=["waveform"], output_names=["clipwise"],
                      dynamic_axes={"waveform": {1: "samples"}}, opset_version=17)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--pooling", default="att", choices=sorted(POOLING))
    parser.add_argument("--frontend", default="logmel", choices=["logmel", "pcen"])
    parser.add_argument("--sample_rate", type=int, default=32000)
    parser.add_argument("--n_fft", type=int, default=1024)
    parser.add_argument("--hop", type=int, default=320)
    parser.add_argument("--n_mels", type=int, default=64)
    parser.add_argument("--channels", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--embed_dim", type=int, default=512)
    parser.add_argument("--num_classes", type=int, default=527)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--mixup", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--out", default="runs/tagger")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.out, exist_ok=True)
    train_loader, eval_loader = build_loaders(args.data_root, args.batch_size, sr=args.sample_rate)

    model = AudioTagger(args).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    best = 0.0
    for epoch in range(args.epochs):
        train(model, train_loader, optimizer, scaler, scheduler, args, epoch)
        stats = evaluate(model, eval_loader)
        logger.info("epoch %d eval %s", epoch, stats)
        if stats["mAP"] > best:
            best = stats["mAP"]
            torch.save({"model": model.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, "best.pt"))
    export_onnx(model, os.path.join(args.out, "tagger_fp16.onnx"), sr=args.sample_rate)


if __name__ == "__main__":
    main()
