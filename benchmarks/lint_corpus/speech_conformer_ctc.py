"""CTC fine-tuning of a small Transformer/Conformer-style encoder on LibriSpeech, bf16 autocast."""
import argparse
import math
import time

import torch as th
import torch.nn as nn
import torch.nn.functional as F
import torchaudio

BF16 = th.bfloat16
LOG_EPS = 1e-8


class SpecAugment(nn.Module):
    def __init__(self, freq_mask=27, time_mask=100, n_freq=2, n_time=2):
        super().__init__()
        self.freq_mask, self.time_mask, self.n_freq, self.n_time = freq_mask, time_mask, n_freq, n_time

    def _mask(self, x, width, axis):
        B, size = x.size(0), x.size(axis)
        w = th.randint(0, width + 1, (B, 1), device=x.device)
        start = (th.rand(B, 1, device=x.device) * (size - w).clamp(min=1)).long()
        ar = th.arange(size, device=x.device)[None, :]
        mask = (ar >= start) & (ar < start + w)
        return x.masked_fill(mask.unsqueeze(1) if axis == 2 else mask.unsqueeze(2), 0.0)

    def forward(self, x):  # (B, T, F)
        if not self.training:
            return x
        for _ in range(self.n_freq):
            x = self._mask(x, self.freq_mask, 2)
        for _ in range(self.n_time):
            x = self._mask(x, self.time_mask, 1)
        return x


class ConvSubsampling(nn.Module):
    def __init__(self, n_mels, d_model):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d_model, 3, 2), nn.ReLU(), nn.Conv2d(d_model, d_model, 3, 2), nn.ReLU())
        self.out = nn.Linear(d_model * (((n_mels - 1) // 2 - 1) // 2), d_model)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        return self.out(x.transpose(1, 2).reshape(b, t, c * f)), ((lens - 1) // 2 - 1) // 2


class CTCEncoder(nn.Module):
    def __init__(self, n_mels=80, d_model=256, n_layers=12, vocab=32):
        super().__init__()
        self.specaug = SpecAugment()
        self.subsample = ConvSubsampling(n_mels, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, feats, lens):
        x, lens = self.subsample(self.specaug(feats), lens)
        pad = th.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        return self.head(self.encoder(x, src_key_padding_mask=pad)), lens


def log_mel(wave, mel):
    return th.log(mel(wave) + LOG_EPS).transpose(-1, -2)


@th.autocast("cuda", dtype=BF16)
def encode(model, feats, lens):
    return model(feats, lens)


def train_epoch(model, loader, optimizer, scheduler, scaler, args, device):
    model.train()
    t0 = time.time()
    for step, (feats, feat_lens, targets, target_lens) in enumerate(loader):
        feats = feats.to(device, dtype=BF16, non_blocking=True)  # expect: AMP001
        feat_lens = feat_lens.to(device)
        logits, out_lens = encode(model, feats, feat_lens)
        log_probs = logits.log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, blank=0, zero_infinity=True)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = th.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f} gnorm {grad_norm.item():.2f} {time.time() - t0:.1f}s")


@th.no_grad()
def evaluate(model, loader, device, blank=0):
    model.eval()
    errors, total = 0, 0
    for feats, feat_lens, targets, target_lens in loader:
        with th.cuda.amp.autocast(dtype=BF16):  # expect: AMP009
            logits, out_lens = model(feats.to(device), feat_lens.to(device))
        hyps = logits.argmax(-1).cpu()
        offset = 0
        for hyp, n, tl in zip(hyps, out_lens.cpu(), target_lens):
            pred = th.unique_consecutive(hyp[:n])
            pred = pred[pred != blank].tolist()
            ref = targets[offset:offset + tl].tolist()
            offset += tl
            errors += torchaudio.functional.edit_distance(ref, pred)
            total += len(ref)
    return errors / max(total, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=10000)
    args = parser.parse_args()
    device = th.device("cuda")
    model = CTCEncoder().to(device)
    optimizer = th.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=1e-3)
    scheduler = th.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    scaler = th.amp.GradScaler("cuda")  # expect: AMP010
    from librispeech import make_loaders  # local helper

    train_loader, dev_loader = make_loaders(batch_seconds=400, feature_fn=log_mel)
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, scheduler, scaler, args, device)
        wer = evaluate(model, dev_loader, device)
        print(f"epoch {epoch}: dev CER {wer:.3%}")
        th.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, f"ctc_epoch{epoch}.pt")


if __name__ == "__main__":
    main()
