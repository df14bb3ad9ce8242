"""Speech recognition with a conformer-like encoder and CTC, trained in mixed precision."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio


class ConvSubsampling(nn.Module):
    def __init__(self, in_dim, d_model):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, d_model, 3, 2), nn.ReLU(), nn.Conv2d(d_model, d_model, 3, 2), nn.ReLU()
        )
        self.out = nn.Linear(d_model * (((in_dim - 1) // 2 - 1) // 2), d_model)

    def forward(self, x, lengths):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, ((lengths - 1) // 2 - 1) // 2


class Encoder(nn.Module):
    def __init__(self, n_mels=80, d_model=256, n_layers=12, vocab=32):
        super().__init__()
        self.subsample = ConvSubsampling(n_mels, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, n_layers)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, feats, feat_lens):
        x, lens = self.subsample(feats, feat_lens)
        pad = torch.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        x = self.layers(x, src_key_padding_mask=pad)
        return self.head(x), lens


def train(args):
    device = torch.device("cuda")
    model = Encoder(vocab=args.vocab).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)
    scaler = torch.amp.GradScaler("cuda")
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    mel = torchaudio.transforms.MelSpectrogram(sample_rate=16000, n_mels=80).to(device)
    loader = []
    step = 0
    while step < args.steps:
        for wav, wav_lens, targets, target_lens in loader:
            wav = wav.to(device)
            feats = (mel(wav) + 1e-6).log().transpose(1, 2)
            feat_lens = wav_lens // 160 + 1
            with torch.autocast("cuda", dtype=torch.float16):
                logits, out_lens = model(feats, feat_lens)
            log_probs = logits.log_softmax(dim=-1).transpose(0, 1)
            loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, zero_infinity=True)  # expect: AMP002
            aux = ctc(logits.transpose(0, 1).log_softmax(-1), targets, out_lens, target_lens)  # expect: AMP002
            total = loss + 0.1 * aux
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(total).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            if math.isfinite(grad_norm):
                scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1


def train_with_fp32_head(args, model, loader, optimizer, scaler):
    """The same step with the recommended form: upcast before the loss."""
    for feats, feat_lens, targets, target_lens in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits, out_lens = model(feats, feat_lens)
        log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, zero_infinity=True)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=100000)
    train(parser.parse_args())
