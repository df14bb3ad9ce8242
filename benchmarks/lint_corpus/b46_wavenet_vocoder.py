"""WaveNet vocoder conditioned on log-mel spectrograms (8-bit mu-law, softmax output).

Residual stack of dilated gated convolutions with local conditioning upsampled by
transposed convolutions. ``train`` is the main mixed-precision recipe; ``finetune_speaker``
adapts a trained vocoder to a new voice, optionally in pure fp16 to fit long receptive fields.
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def mu_law_encode(audio, channels=256):
    mu = channels - 1
    x = np.sign(audio) * np.log1p(mu * np.abs(audio)) / np.log1p(mu)
    return ((x + 1) / 2 * mu + 0.5).astype(np.int64)


def mu_law_decode(idx, channels=256):
    mu = channels - 1
    x = 2 * (idx.float() / mu) - 1
    return torch.sign(x) * ((1 + mu) ** torch.abs(x) - 1) / mu


class ConditionNetwork(nn.Module):
    """Mel frames -> per-sample conditioning: conv, per-utterance mean removal, upsampling."""

    def __init__(self, n_mels, cond_channels, upsample_scales):
        super().__init__()
        self.conv_in = nn.Conv1d(n_mels, cond_channels, kernel_size=5, padding=2)
        self.upsample = nn.Sequential(*[
            nn.ConvTranspose1d(cond_channels, cond_channels, 2 * s, stride=s, padding=s // 2)
            for s in upsample_scales
        ])

    def forward(self, mel):
        c = self.conv_in(mel)
        c = c - c.mean(dim=-1, keepdim=True)  # expect: AMP004
        return self.upsample(c)


class ResidualBlock(nn.Module):
    def __init__(self, res_ch, gate_ch, skip_ch, cond_ch, kernel_size, dilation, dropout=0.05):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dilated = nn.Conv1d(res_ch, gate_ch, kernel_size, dilation=dilation, padding=(kernel_size - 1) * dilation)
        self.cond = nn.Conv1d(cond_ch, gate_ch, 1, bias=False)
        self.out = nn.Conv1d(gate_ch // 2, res_ch + skip_ch, 1)
        self.res_ch = res_ch

    def forward(self, x, c):
        h = self.dilated(self.dropout(x))[:, :, : x.size(-1)]
        a, b = (h + self.cond(c)).chunk(2, dim=1)
        out = self.out(torch.tanh(a) * torch.sigmoid(b))
        res, skip = out.split([self.res_ch, out.size(1) - self.res_ch], dim=1)
        return (x + res) * math.sqrt(0.5), skip


class WaveNet(nn.Module):
    def __init__(self, classes=256, res_channels=64, gate_channels=128, skip_channels=64, cond_channels=80,
                 n_mels=80, layers=24, cycle=12, kernel_size=3, upsample_scales=(4, 4, 4, 4)):
        super().__init__()
        self.embed = nn.Embedding(classes, res_channels)
        self.cond_net = ConditionNetwork(n_mels, cond_channels, upsample_scales)
        self.blocks = nn.ModuleList([
            ResidualBlock(res_channels, gate_channels, skip_channels, cond_channels, kernel_size, 2 ** (i % cycle))
            for i in range(layers)
        ])
        self.skip_proj = nn.Conv1d(skip_channels, skip_channels, 1)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(skip_channels, skip_channels, 1), nn.ReLU(),
                                  nn.Conv1d(skip_channels, classes, 1))

    def _normalize_energy(self, h):
        energy = h.abs().mean(dim=-1, keepdim=True)  # expect: AMP004
        return h / (energy + 1e-8)  # expect: AMP011

    def forward(self, audio_idx, mel):
        c = self.cond_net(mel)[:, :, : audio_idx.size(1)]
        x = self.embed(audio_idx).transpose(1, 2)
        skip_sum = 0.0
        for block in self.blocks:
            x, s = block(x, c)
            skip_sum = skip_sum + s
        h = self.skip_proj(skip_sum * math.sqrt(1.0 / len(self.blocks)))
        return self.head(self._normalize_energy(h))


def build_vocoder(cfg):
    return WaveNet(layers=cfg.layers, cycle=cfg.cycle, res_channels=cfg.channels, skip_channels=cfg.channels,
                   gate_channels=2 * cfg.channels)


class MelAudioDataset(torch.utils.data.Dataset):
    def __init__(self, items, seq_len=8000, hop=256):
        self.items, self.seq_len, self.hop = items, seq_len, hop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        audio, mel = self.items[i]
        frames = self.seq_len // self.hop
        start = np.random.randint(0, max(1, mel.shape[1] - frames))
        mel_seg = mel[:, start : start + frames]
        wav = audio[start * self.hop : start * self.hop + self.seq_len + 1]
        return torch.from_numpy(mu_law_encode(wav)), torch.from_numpy(mel_seg).float()


def train(model, loader, args, device):
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    model.train()
    for epoch in range(args.epochs):
        for audio_idx, mel in loader:
            audio_idx, mel = audio_idx.to(device), mel.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(audio_idx[:, :-1], mel)
            loss = F.cross_entropy(logits, audio_idx[:, 1:])  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
        print(f"epoch {epoch} loss {loss.item():.4f} grad-norm {grad_norm:.2f}")
    return model


def finetune_speaker(model, loader, args, device):
    """Adapt to a new speaker; ``--fp16`` keeps weights in half precision to fit long contexts."""
    if args.fp16:
        model = model.half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.ft_lr)  # expect: AMP011
    model.train()
    for step, (audio_idx, mel) in enumerate(loader):
        audio_idx, mel = audio_idx.to(device), mel.to(device)
        if args.fp16:
            mel = mel.half()
        loss = F.cross_entropy(model(audio_idx[:, :-1], mel), audio_idx[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= args.ft_steps:
            break


@torch.inference_mode()
def generate(model, mel, n_samples, device, temperature=1.0):
    """Naive (non-cached) ancestral sampling, half precision."""
    model = model.eval().half()
    mel = mel.to(device).half()
    idx = torch.full((1, 1), 128, dtype=torch.long, device=device)
    for _ in range(n_samples):
        logits = model(idx[:, -4096:], mel)[:, :, -1]
        probs = F.softmax(logits.float() / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1)], dim=1)
    return mu_law_decode(idx[0, 1:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/ljspeech_mels.npz")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--cycle", type=int, default=12)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ft-lr", type=float, default=1e-4)
    p.add_argument("--ft-steps", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--speaker-data", default="")
    args = p.parse_args()
    device = torch.device("cuda")
    archive = np.load(args.data, allow_pickle=True)
    loader = torch.utils.data.DataLoader(MelAudioDataset(list(archive["items"])), batch_size=8, shuffle=True,
                                         num_workers=4, drop_last=True)
    model = build_vocoder(args)
    model.to(device)
    model = train(model, loader, args, device)
    torch.save(model.state_dict(), "wavenet.pt")
    if args.speaker_data:
        spk = np.load(args.speaker_data, allow_pickle=True)
        spk_loader = torch.utils.data.DataLoader(MelAudioDataset(list(spk["items"])), batch_size=4, shuffle=True)
        finetune_speaker(model, spk_loader, args, device)
    wav = generate(model, torch.from_numpy(archive["items"][0][1][None]).float(), 16000, device)
    np.save("sample.npy", wav.cpu().numpy())


if __name__ == "__main__":
    main()
