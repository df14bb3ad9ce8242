"""Conformer-CTC acoustic model with an end-of-utterance (EOU) head for streaming endpointing.

Features are computed on the GPU inside the model (log-mel from raw 16 kHz audio) so the
data loader only decodes audio. Written against the torch 1.x AMP API and never ported.
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.cuda.amp import GradScaler, autocast


def mel_filterbank(sample_rate, n_fft, n_mels, fmin=0.0, fmax=None):
    fmax = fmax or sample_rate / 2
    hz_to_mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)  # noqa: E731
    mels = torch.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lower = (freqs[:, None] - hz[None, :-2]) / (hz[1:-1] - hz[:-2])[None, :]
    upper = (hz[None, 2:] - freqs[:, None]) / (hz[2:] - hz[1:-1])[None, :]
    return torch.clamp(torch.minimum(lower, upper), min=0.0)  # [n_freq, n_mels]


class LogMelFrontend(nn.Module):
    def __init__(self, sample_rate=16000, n_fft=400, hop_length=160, n_mels=80):
        super().__init__()
        self.n_fft, self.hop_length = n_fft, hop_length
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer("mel_fb", mel_filterbank(sample_rate, n_fft, n_mels), persistent=False)

    def forward(self, wav):
        spec = torch.stft(wav, self.n_fft, self.hop_length, window=self.window, return_complex=True)
        power = spec.abs().pow(2).transpose(1, 2)  # [B, T, F]
        mel = torch.matmul(power, self.mel_fb)
        return torch.log(mel + 1e-10)  # expect: AMP011


class SpecAugment(nn.Module):
    def __init__(self, freq_masks=2, freq_width=27, time_masks=10, time_width=0.05):
        super().__init__()
        self.freq_masks, self.freq_width = freq_masks, freq_width
        self.time_masks, self.time_width = time_masks, time_width

    def forward(self, x):  # [B, T, F]
        B, T, Fdim = x.shape
        for _ in range(self.freq_masks):
            f = int(torch.randint(0, self.freq_width + 1, ()))
            f0 = int(torch.randint(0, max(1, Fdim - f), ()))
            x[:, :, f0:f0 + f] = 0.0
        for _ in range(self.time_masks):
            t = int(torch.randint(0, int(self.time_width * T) + 1, ()))
            t0 = int(torch.randint(0, max(1, T - t), ()))
            x[:, t0:t0 + t, :] = 0.0
        return x


class Conv2dSubsampling(nn.Module):
    """4x time reduction, then a projection to the model width and utterance normalisation."""

    def __init__(self, n_mels, d_model, channels=256):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, 3, 2), nn.ReLU(), nn.Conv2d(channels, channels, 3, 2), nn.ReLU()
        )
        self.out = nn.Linear(channels * (((n_mels - 1) // 2 - 1) // 2), d_model)

    def forward(self, feats, feat_lens):
        x = self.conv(feats.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        x = (x - x.mean(dim=1, keepdim=True)) / torch.sqrt(x.var(dim=1, keepdim=True) + 1e-5)  # expect: AMP004
        return x, ((feat_lens - 1) // 2 - 1) // 2


class MHSA(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        # padded queries and padded keys are both excluded
        blocked = pad_mask[:, None, :, None] | pad_mask[:, None, None, :]
        scores = torch.where(blocked, torch.tensor(-1e9, device=scores.device), scores)  # expect: AMP007
        attn = self.dropout(torch.softmax(scores, dim=-1))
        return self.out(torch.matmul(attn, v).transpose(1, 2).reshape(B, T, -1))


class ConformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, kernel_size=31, dropout=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Dropout(dropout), nn.Linear(4 * d_model, d_model))
        self.ln_att = nn.LayerNorm(d_model)
        self.att = MHSA(d_model, n_heads, dropout)
        self.ln_conv = nn.LayerNorm(d_model)
        self.pw1 = nn.Conv1d(d_model, 2 * d_model, 1)
        self.dw = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.bn = nn.BatchNorm1d(d_model)
        self.pw2 = nn.Conv1d(d_model, d_model, 1)
        self.ff2 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Dropout(dropout), nn.Linear(4 * d_model, d_model))
        self.ln_out = nn.LayerNorm(d_model)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.att(self.ln_att(x), pad_mask)
        c = F.glu(self.pw1(self.ln_conv(x).transpose(1, 2)), dim=1)
        c = c.masked_fill(pad_mask[:, None, :], 0.0)
        x = x + self.pw2(F.silu(self.bn(self.dw(c)))).transpose(1, 2)
        x = x + 0.5 * self.ff2(x)
        return self.ln_out(x)


class ConformerCTC(nn.Module):
    def __init__(self, vocab_size, d_model=256, n_heads=4, n_layers=16):
        super().__init__()
        self.frontend = LogMelFrontend()
        self.specaug = SpecAugment()
        self.subsample = Conv2dSubsampling(80, d_model)
        self.blocks = nn.ModuleList([ConformerBlock(d_model, n_heads) for _ in range(n_layers)])
        self.ctc_head = nn.Linear(d_model, vocab_size)
        self.eou_head = nn.Linear(d_model, 1)

    def forward(self, wav, wav_lens):
        feats = self.frontend(wav)
        if self.training:
            feats = self.specaug(feats)
        x, lens = self.subsample(feats, wav_lens // self.frontend.hop_length + 1)
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        for blk in self.blocks:
            x = blk(x, pad_mask)
        return self.ctc_head(x), self.eou_head(x).squeeze(-1), lens


def train_one_epoch(model, loader, optimizer, scheduler, scaler, args, epoch):
    model.train()
    t0 = time.time()
    for step, (wav, wav_lens, targets, target_lens, eou_tgt) in enumerate(loader):
        wav, wav_lens = wav.cuda(non_blocking=True), wav_lens.cuda(non_blocking=True)
        targets, target_lens = targets.cuda(non_blocking=True), target_lens.cuda(non_blocking=True)
        eou_tgt = eou_tgt.cuda(non_blocking=True)
        with autocast(enabled=args.amp):  # expect: AMP009
            logits, eou_logits, out_lens = model(wav, wav_lens)
            eou_loss = F.binary_cross_entropy(torch.sigmoid(eou_logits), eou_tgt)  # expect: AMP003
        log_probs = logits.log_softmax(dim=-1).transpose(0, 1)
        ctc = F.ctc_loss(log_probs, targets, out_lens, target_lens, blank=0, zero_infinity=True)  # expect: AMP002
        loss = ctc + args.eou_weight * eou_loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % args.log_every == 0:
            print(f"ep {epoch} it {step} ctc {ctc.item():.3f} eou {eou_loss.item():.3f} "
                  f"gnorm {grad_norm:.2f} scale {scaler.get_scale():.0f} {time.time() - t0:.1f}s")


def split_by_duration(batch, max_frames):
    wav, wav_lens, *rest = batch
    n = max(1, int(wav_lens.sum().item() // max_frames) + 1)
    for idx in torch.arange(wav.size(0)).chunk(n):
        yield (wav[idx], wav_lens[idx], *(r[idx] for r in rest))


def train_one_epoch_accum(model, loader, optimizer, scheduler, scaler, args):
    """For long-form data: split each batch into micro-batches by total duration."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(loader):
        micro_batches = list(split_by_duration(batch, args.max_frames))
        for micro in micro_batches:
            wav, wav_lens, targets, target_lens, _ = (t.cuda(non_blocking=True) for t in micro)
            with autocast(enabled=args.amp):  # expect: AMP009
                logits, _, out_lens = model(wav, wav_lens)
                log_probs = logits.float().log_softmax(-1).transpose(0, 1)
                loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, zero_infinity=True)
                scaler.scale(loss / len(micro_batches)).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


@torch.inference_mode()
def evaluate(model, loader, blank=0):
    model.eval()
    errs, total = 0, 0
    for wav, wav_lens, targets, target_lens, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _, out_lens = model(wav.cuda(), wav_lens.cuda())
        best = logits.float().argmax(-1).cpu()
        for b in range(best.size(0)):
            hyp = torch.unique_consecutive(best[b, : out_lens[b]])
            hyp = hyp[hyp != blank].tolist()
            ref = targets[b, : target_lens[b]].tolist()
            errs += edit_distance(hyp, ref)
            total += len(ref)
    model.train()
    return errs / max(total, 1)


def edit_distance(a, b):
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--eou_weight", type=float, default=0.1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--long_form", action="store_true")
    p.add_argument("--max_frames", type=int, default=16000 * 240)
    p.add_argument("--log_every", type=int, default=100)
    args = p.parse_args()

    from asr.data import build_loaders  # project-local

    train_loader, dev_loader = build_loaders(args)
    model = ConformerCTC(args.vocab).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader))
    scaler = GradScaler(enabled=args.amp, init_scale=2.0 ** 14)  # expect: AMP009
    best_wer = float("inf")
    for epoch in range(args.epochs):
        if args.long_form:
            train_one_epoch_accum(model, train_loader, optimizer, scheduler, scaler, args)
        else:
            train_one_epoch(model, train_loader, optimizer, scheduler, scaler, args, epoch)
        wer = evaluate(model, dev_loader)
        if wer < best_wer:
            best_wer = wer
            torch.save(model.state_dict(), os.path.join("exp", "best.pt"))
        print(f"epoch {epoch} dev CER {wer:.4f}")


if __name__ == "__main__":
    main()
