"""FastSpeech2-style variance adaptor with a reference (style) encoder.

Duration, pitch and energy predictors run on the phoneme encoder output; a reference
encoder summarises a target mel with statistics pooling into a style vector.
"""
import argparse
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from text.symbols import symbols
from dataset import TTSDataset, collate_tts
from model.encoder import PhonemeEncoder, MelDecoder

log = logging.getLogger(__name__)


def get_mask_from_lengths(lengths, max_len=None):
    max_len = max_len or int(lengths.max().item())
    ids = torch.arange(max_len, device=lengths.device)
    return ids.unsqueeze(0) < lengths.unsqueeze(1)


def masked_mean(x, mask, dim=1):
    """Mean over valid frames; mask is (B, T) bool."""
    m = mask.unsqueeze(-1).to(x.dtype) if x.dim() == 3 else mask.to(x.dtype)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


class Conv1dLN(nn.Module):
    def __init__(self, in_ch, out_ch, kernel_size, dropout):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel_size, padding=(kernel_size - 1) // 2)
        self.norm = nn.LayerNorm(out_ch)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.dropout(self.norm(F.relu(x)))


class VariancePredictor(nn.Module):
    def __init__(self, d_model, filter_size=256, kernel_size=3, dropout=0.5):
        super().__init__()
        self.layers = nn.Sequential(
            Conv1dLN(d_model, filter_size, kernel_size, dropout),
            Conv1dLN(filter_size, filter_size, kernel_size, dropout),
        )
        self.linear = nn.Linear(filter_size, 1)

    def forward(self, x, mask):
        out = self.linear(self.layers(x)).squeeze(-1)
        return out.masked_fill(~mask, 0.0)


class ReferenceEncoder(nn.Module):
    """Conv stack over the mel, then mean/std statistics pooling (x-vector style)."""

    def __init__(self, n_mels, channels=(32, 64, 128), style_dim=128):
        super().__init__()
        convs, c_in = [], n_mels
        for c in channels:
            convs += [nn.Conv1d(c_in, c, 3, padding=1), nn.ReLU()]
            c_in = c
        self.convs = nn.Sequential(*convs)
        self.frame_proj = nn.Linear(c_in, style_dim)
        self.out = nn.Linear(2 * style_dim, style_dim)

    def forward(self, mel):
        h = self.convs(mel.transpose(1, 2)).transpose(1, 2)
        h = self.frame_proj(h)
        mu = h.mean(dim=1)  # expect: AMP004
        sigma = torch.sqrt(h.var(dim=1, unbiased=False) + 1e-10)  # expect: AMP004 AMP011
        return torch.tanh(self.out(torch.cat([mu, sigma], dim=-1)))


class LengthRegulator(nn.Module):
    def forward(self, x, durations, max_len=None):
        out = [torch.repeat_interleave(seq, d.long(), dim=0) for seq, d in zip(x, durations)]
        out = nn.utils.rnn.pad_sequence(out, batch_first=True)
        if max_len is not None:
            out = out[:, :max_len]
        mel_len = durations.long().sum(dim=1)
        return out, mel_len


class VarianceAdaptor(nn.Module):
    def __init__(self, d_model, n_bins=256, pitch_range=(-3.0, 10.0), energy_range=(-2.0, 8.0)):
        super().__init__()
        self.duration_predictor = VariancePredictor(d_model)
        self.pitch_predictor = VariancePredictor(d_model)
        self.energy_predictor = VariancePredictor(d_model)
        self.length_regulator = LengthRegulator()
        self.register_buffer("pitch_bins", torch.linspace(*pitch_range, n_bins - 1))
        self.register_buffer("energy_bins", torch.linspace(*energy_range, n_bins - 1))
        self.pitch_embedding = nn.Embedding(n_bins, d_model)
        self.energy_embedding = nn.Embedding(n_bins, d_model)

    def forward(self, x, src_mask, mel_mask=None, max_mel_len=None, duration_target=None,
                pitch_target=None, energy_target=None, d_control=1.0):
        log_duration = self.duration_predictor(x, src_mask)
        pitch = self.pitch_predictor(x, src_mask)
        energy = self.energy_predictor(x, src_mask)
        p = pitch_target if pitch_target is not None else pitch
        e = energy_target if energy_target is not None else energy
        x = x + self.pitch_embedding(torch.bucketize(p.float(), self.pitch_bins))
        x = x + self.energy_embedding(torch.bucketize(e.float(), self.energy_bins))
        if duration_target is not None:
            durations = duration_target
        else:
            durations = torch.clamp(torch.round(torch.exp(log_duration.float()) - 1) * d_control, min=0)
        x, mel_len = self.length_regulator(x, durations, max_mel_len)
        return x, log_duration, pitch, energy, mel_len


class FastSpeech2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = PhonemeEncoder(len(symbols), cfg.d_model, cfg.n_layers)
        self.style = ReferenceEncoder(cfg.n_mels, style_dim=cfg.d_model)
        self.adaptor = VarianceAdaptor(cfg.d_model)
        self.decoder = MelDecoder(cfg.d_model, cfg.n_layers)
        self.mel_linear = nn.Linear(cfg.d_model, cfg.n_mels)

    def forward(self, phonemes, src_lens, mels, mel_lens, durations=None, pitches=None, energies=None):
        src_mask = get_mask_from_lengths(src_lens)
        mel_mask = get_mask_from_lengths(mel_lens, mels.size(1))
        x = self.encoder(phonemes, src_mask)
        x = x + self.style(mels).unsqueeze(1)
        x, log_d, p, e, out_lens = self.adaptor(x, src_mask, mel_mask, mels.size(1), durations, pitches, energies)
        mel = self.mel_linear(self.decoder(x, mel_mask))
        return {"mel": mel, "log_duration": log_d, "pitch": p, "energy": e,
                "src_mask": src_mask, "mel_mask": mel_mask}


class FastSpeech2Loss(nn.Module):
    def forward(self, out, batch):
        src_mask, mel_mask = out["src_mask"], out["mel_mask"]
        log_d_target = torch.log(batch["durations"].float() + 1)
        mel_loss = F.l1_loss(out["mel"].masked_select(mel_mask.unsqueeze(-1)),
                             batch["mels"].masked_select(mel_mask.unsqueeze(-1)))
        d_loss = F.mse_loss(out["log_duration"].masked_select(src_mask), log_d_target.masked_select(src_mask))
        p_loss = F.mse_loss(out["pitch"].masked_select(src_mask), batch["pitches"].masked_select(src_mask))
        e_loss = F.mse_loss(out["energy"].masked_select(src_mask), batch["energies"].masked_select(src_mask))
        total = mel_loss + d_loss + p_loss + e_loss
        return total, {"mel": mel_loss.item(), "dur": d_loss.item(), "pitch": p_loss.item(), "energy": e_loss.item()}


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def train(model, loader, optimizer, scaler, criterion, args, device, step=0):
    model.train()
    for epoch in range(args.epochs):
        for batch in loader:
            batch = to_device(batch, device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                out = model(batch["phonemes"], batch["src_lens"], batch["mels"], batch["mel_lens"],
                            batch["durations"], batch["pitches"], batch["energies"])
                loss, parts = criterion(out, batch)
                with torch.no_grad():
                    pitch_err = masked_mean((out["pitch"].float() - batch["pitches"]).abs(), out["src_mask"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step % args.log_every == 0:
                log.info("step %d loss %.4f %s pitch_mae %.3f gnorm %.2f", step, loss.item(), parts,
                         pitch_err.mean().item(), grad_norm.item())
            if step % args.save_every == 0:
                torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "step": step},
                           os.path.join(args.ckpt_dir, f"fs2_{step}.pt"))
    return step


@torch.no_grad()
def synthesize(model, phonemes, src_lens, ref_mel, d_control=1.0):
    model.eval()
    src_mask = get_mask_from_lengths(src_lens)
    x = model.encoder(phonemes, src_mask)
    x = x + model.style(ref_mel).unsqueeze(1)
    x, _, _, _, mel_lens = model.adaptor(x, src_mask, d_control=d_control)
    mel_mask = get_mask_from_lengths(mel_lens)
    return model.mel_linear(model.decoder(x, mel_mask)), mel_lens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--ckpt-dir", default="ckpt/fs2")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-mels", type=int, default=80)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=5000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    device = torch.device("cuda")
    loader = DataLoader(TTSDataset(args.data_dir), batch_size=args.batch_size, shuffle=True,
                        collate_fn=collate_tts, num_workers=4, pin_memory=True, drop_last=True)
    model = FastSpeech2(args).to(device)
    criterion = FastSpeech2Loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)  # expect: AMP009
    train(model, loader, optimizer, scaler, criterion, args, device)


if __name__ == "__main__":
    main()
