"""Character-level CTC speech recognition on LibriSpeech.

Log-mel features are computed on the GPU from raw waveforms, followed by a
2x2 convolutional subsampler and a pre-norm Transformer encoder.
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torchaudio
from torch.utils.data import DataLoader

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


@dataclass
class TrainConfig:
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 80
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 12
    lr: float = 1e-3
    warmup: int = 10000
    weight_decay: float = 1e-3
    grad_clip: float = 5.0
    batch_size: int = 32
    epochs: int = 60


class ConvSubsampler(nn.Module):
    def __init__(self, n_mels, d_model):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, d_model, 3, stride=2), nn.ReLU(),
            nn.Conv2d(d_model, d_model, 3, stride=2), nn.ReLU(),
        )
        freq = ((n_mels - 1) // 2 - 1) // 2
        self.proj = nn.Linear(d_model * freq, d_model)

    def forward(self, feats, lens):
        x = self.conv(feats.unsqueeze(1))  # (B, C, T', F')
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        return x, lens


class ASRModel(nn.Module):
    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.subsample = ConvSubsampler(cfg.n_mels, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 4 * cfg.d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers)
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, feats, feat_lens):
        x, lens = self.subsample(feats, feat_lens)
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        return self.head(x), lens


def collate(batch):
    waves = [item[0].squeeze(0) for item in batch]
    texts = [item[2].lower() for item in batch]
    wave_lens = torch.tensor([w.numel() for w in waves])
    padded = nn.utils.rnn.pad_sequence(waves, batch_first=True)
    ids = [torch.tensor([CHAR2ID[ch] for ch in t if ch in CHAR2ID]) for t in texts]
    target_lens = torch.tensor([len(x) for x in ids])
    return padded, wave_lens, torch.cat(ids), target_lens


def edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


class CTCTrainer:
    def __init__(self, model, cfg, device):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.window = torch.hann_window(cfg.n_fft, device=device)
        self.mel_fb = torchaudio.functional.melscale_fbanks(
            cfg.n_fft // 2 + 1, 0.0, cfg.sample_rate / 2, cfg.n_mels, cfg.sample_rate
        ).to(device)
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=True)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9,
                                           weight_decay=cfg.weight_decay)
        warmup = cfg.warmup
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min((s + 1) / warmup, math.sqrt(warmup / (s + 1)))
        )
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
        self.global_step = 0

    def power_spectrum(self, waves):
        spec = torch.stft(waves, self.cfg.n_fft, hop_length=self.cfg.hop, window=self.window,
                          return_complex=True)
        return spec.abs().pow(2).transpose(1, 2)  # (B, T, n_freq)

    def frame_lengths(self, wave_lens):
        return wave_lens // self.cfg.hop + 1

    def train_step(self, batch):
        waves, wave_lens, targets, target_lens = (t.to(self.device, non_blocking=True) for t in batch)
        power = self.power_spectrum(waves)
        feat_lens = self.frame_lengths(wave_lens)

        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            mel = torch.matmul(power, self.mel_fb)
            feats = torch.log(mel + 1e-10)  # expect: AMP011
            logits, out_lens = self.model(feats, feat_lens)
            log_probs = logits.log_softmax(dim=-1).transpose(0, 1)
            loss = self.ctc(log_probs, targets, out_lens, target_lens)
            self.scaler.scale(loss).backward()  # expect: AMP008

        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)  # expect: AMP005
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.scheduler.step()
        self.global_step += 1
        return loss.item()

    @torch.no_grad()
    def validate(self, loader, max_batches=50):
        self.model.eval()
        errors, chars = 0, 0
        for i, batch in enumerate(loader):
            if i >= max_batches:
                break
            waves, wave_lens, targets, target_lens = (t.to(self.device) for t in batch)
            feats = torch.log(torch.matmul(self.power_spectrum(waves), self.mel_fb).clamp(min=1e-10))
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                logits, out_lens = self.model(feats, self.frame_lengths(wave_lens))
            best = logits.argmax(dim=-1).cpu()
            refs = torch.split(targets.cpu(), target_lens.cpu().tolist())
            for hyp_ids, n, ref in zip(best, out_lens.cpu().tolist(), refs):
                hyp = torch.unique_consecutive(hyp_ids[:n])
                hyp = [int(t) for t in hyp if t != 0]
                errors += edit_distance(hyp, ref.tolist())
                chars += len(ref)
        self.model.train()
        return errors / max(1, chars)

    def save(self, path, epoch):
        torch.save({
            "epoch": epoch,
            "step": self.global_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/librispeech")
    p.add_argument("--train-split", default="train-clean-100")
    p.add_argument("--val-split", default="dev-clean")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--ckpt-dir", default="ckpt/ctc")
    args = p.parse_args()

    cfg = TrainConfig()
    if args.epochs is not None:
        cfg.epochs = args.epochs
    device = torch.device("cuda")
    train_set = torchaudio.datasets.LIBRISPEECH(args.root, url=args.train_split, download=False)
    val_set = torchaudio.datasets.LIBRISPEECH(args.root, url=args.val_split, download=False)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, collate_fn=collate, num_workers=4)

    trainer = CTCTrainer(ASRModel(cfg, len(VOCAB)), cfg, device)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(cfg.epochs):
        t0, total = time.time(), 0.0
        for i, batch in enumerate(train_loader):
            total += trainer.train_step(batch)
            if (i + 1) % 100 == 0:
                print(f"epoch {epoch} it {i + 1} loss {total / (i + 1):.3f} "
                      f"lr {trainer.scheduler.get_last_lr()[0]:.2e}")
        cer = trainer.validate(val_loader)
        print(f"epoch {epoch} done in {time.time() - t0:.0f}s, dev CER {cer:.3%}")
        trainer.save(os.path.join(args.ckpt_dir, f"epoch{epoch:03d}.pt"), epoch)


if __name__ == "__main__":
    main()
