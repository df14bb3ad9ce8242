"""FastSpeech2-style acoustic model: FFT encoder, reference (style) encoder,
variance adaptor (duration / pitch / energy / voicing), length regulator,
FFT mel decoder and a convolutional postnet.

Mixed precision is switched by --amp: CUDA fp16 autocast and a GradScaler that
are both enabled by the same flag.  The trainer builds the model from a
registry entry.
"""
import argparse
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class VarianceOut(NamedTuple):
    hidden: torch.Tensor
    mel_len: torch.Tensor
    log_dur: torch.Tensor
    pitch: torch.Tensor
    energy: torch.Tensor
    vuv_logit: torch.Tensor


@dataclass
class TTSOutput:
    mel: torch.Tensor
    mel_post: torch.Tensor
    log_dur: torch.Tensor
    pitch: torch.Tensor
    energy: torch.Tensor
    vuv_logit: torch.Tensor
    mel_mask: torch.Tensor


def sinusoid_table(n_pos, dim):
    pos = torch.arange(n_pos).unsqueeze(1).float()
    div = torch.exp(torch.arange(0, dim, 2).float() * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return table


def get_mask_from_lengths(lengths, max_len):
    ids = torch.arange(max_len, device=lengths.device)
    return ids.unsqueeze(0) >= lengths.unsqueeze(1)  # True on padding


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.w_qkv = nn.Linear(dim, 3 * dim)
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, d = x.shape
        q, k, v = self.w_qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(torch.softmax(scores, dim=-1))
        return self.fc((attn @ v).transpose(1, 2).reshape(b, t, d))


class FFTBlock(nn.Module):
    def __init__(self, dim, heads, filt, kernel, dropout):
        super().__init__()
        self.attn = MultiHeadAttention(dim, heads, dropout)
        self.norm1 = nn.LayerNorm(dim)
        self.conv1 = nn.Conv1d(dim, filt, kernel, padding=kernel // 2)
        self.conv2 = nn.Conv1d(filt, dim, 1)
        self.norm2 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        x = self.norm1(x + self.drop(self.attn(x, pad_mask)))
        x = x.masked_fill(pad_mask.unsqueeze(-1), 0.0)
        h = self.conv2(F.relu(self.conv1(x.transpose(1, 2)))).transpose(1, 2)
        x = self.norm2(x + self.drop(h))
        return x.masked_fill(pad_mask.unsqueeze(-1), 0.0)


class ReferenceEncoder(nn.Module):
    """Utterance-level style vector from the target mel: conv stack + statistics pooling."""

    def __init__(self, n_mels, dim):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, dim, 3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, 3, padding=1)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, mel):  # [B, T, n_mels]
        h = self.conv2(F.relu(self.conv1(mel.transpose(1, 2))))
        mu = h.mean(dim=-1)  # expect: AMP004
        sigma = torch.sqrt(h.var(dim=-1) + 1e-8)  # expect: AMP004, AMP011
        return torch.tanh(self.proj(torch.cat([mu, sigma], dim=-1)))


class VariancePredictor(nn.Module):
    def __init__(self, dim, filt=256, kernel=3, dropout=0.5):
        super().__init__()
        self.conv1 = nn.Conv1d(dim, filt, kernel, padding=kernel // 2)
        self.ln1 = nn.LayerNorm(filt)
        self.conv2 = nn.Conv1d(filt, filt, kernel, padding=kernel // 2)
        self.ln2 = nn.LayerNorm(filt)
        self.drop = nn.Dropout(dropout)
        self.proj = nn.Linear(filt, 1)

    def forward(self, x, pad_mask):
        h = self.drop(self.ln1(F.relu(self.conv1(x.transpose(1, 2))).transpose(1, 2)))
        h = self.drop(self.ln2(F.relu(self.conv2(h.transpose(1, 2))).transpose(1, 2)))
        return self.proj(h).squeeze(-1).masked_fill(pad_mask, 0.0)


def regulate_length(x, durations, max_len=None):
    out = [torch.repeat_interleave(xi, di, dim=0) for xi, di in zip(x, durations)]
    mel_len = torch.tensor([o.size(0) for o in out], device=x.device)
    out = nn.utils.rnn.pad_sequence(out, batch_first=True)
    if max_len is not None:
        out = F.pad(out, (0, 0, 0, max(0, max_len - out.size(1))))[:, :max_len]
    return out, mel_len


class VarianceAdaptor(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.duration = VariancePredictor(cfg.dim)
        self.pitch = VariancePredictor(cfg.dim)
        self.energy = VariancePredictor(cfg.dim)
        self.vuv = VariancePredictor(cfg.dim)
        self.register_buffer("pitch_bins", torch.linspace(-3.0, 3.0, cfg.n_bins - 1))
        self.register_buffer("energy_bins", torch.linspace(-2.0, 4.0, cfg.n_bins - 1))
        self.pitch_emb = nn.Embedding(cfg.n_bins, cfg.dim)
        self.energy_emb = nn.Embedding(cfg.n_bins, cfg.dim)

    def _embed(self, values, bins, table):
        return table(torch.bucketize(values.float(), bins))

    def forward(self, x, src_mask, durations=None, pitch=None, energy=None, max_mel_len=None):
        log_dur = self.duration(x, src_mask)
        pitch_pred = self.pitch(x, src_mask)
        energy_pred = self.energy(x, src_mask)
        vuv_logit = self.vuv(x, src_mask)
        x = x + self._embed(pitch if pitch is not None else pitch_pred.detach(), self.pitch_bins, self.pitch_emb)
        x = x + self._embed(energy if energy is not None else energy_pred.detach(), self.energy_bins, self.energy_emb)
        if durations is None:
            durations = torch.clamp(torch.round(torch.exp(log_dur.float()) - 1.0), min=0).long()
        x, mel_len = regulate_length(x, durations, max_mel_len)
        return VarianceOut(
            hidden=x, mel_len=mel_len, log_dur=log_dur, pitch=pitch_pred, energy=energy_pred, vuv_logit=vuv_logit
        )


class PostNet(nn.Module):
    def __init__(self, n_mels, ch=256, kernel=5, n_layers=5):
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(n_layers):
            cin = n_mels if i == 0 else ch
            cout = n_mels if i == n_layers - 1 else ch
            self.layers.append(nn.Sequential(nn.Conv1d(cin, cout, kernel, padding=kernel // 2), nn.BatchNorm1d(cout)))

    def forward(self, mel):
        x = mel.transpose(1, 2)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.dropout(torch.tanh(x), 0.5, self.training)
        return x.transpose(1, 2)


class FastSpeech2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.n_symbols, cfg.dim, padding_idx=0)
        self.register_buffer("pos", sinusoid_table(cfg.max_len, cfg.dim), persistent=False)
        self.encoder = nn.ModuleList(FFTBlock(cfg.dim, 2, 1024, 9, 0.2) for _ in range(cfg.enc_layers))
        self.ref_enc = ReferenceEncoder(cfg.n_mels, cfg.dim)
        self.adaptor = VarianceAdaptor(cfg)
        self.decoder = nn.ModuleList(FFTBlock(cfg.dim, 2, 1024, 9, 0.2) for _ in range(cfg.dec_layers))
        self.mel_linear = nn.Linear(cfg.dim, cfg.n_mels)
        self.postnet = PostNet(cfg.n_mels)

    def forward(self, text, text_len, mel=None, mel_len=None, durations=None, pitch=None, energy=None):
        src_mask = get_mask_from_lengths(text_len, text.size(1))
        x = self.embed(text) + self.pos[: text.size(1)]
        for blk in self.encoder:
            x = blk(x, src_mask)
        if mel is not None:
            x = x + self.ref_enc(mel).unsqueeze(1)
        va = self.adaptor(x, src_mask, durations, pitch, energy, mel.size(1) if mel is not None else None)
        mel_mask = get_mask_from_lengths(mel_len if mel_len is not None else va.mel_len, va.hidden.size(1))
        h = va.hidden
        for blk in self.decoder:
            h = blk(h, mel_mask)
        mel_out = self.mel_linear(h)
        mel_post = mel_out + self.postnet(mel_out)
        return TTSOutput(
            mel=mel_out, mel_post=mel_post, log_dur=va.log_dur, pitch=va.pitch,
            energy=va.energy, vuv_logit=va.vuv_logit, mel_mask=mel_mask,
        )


MODELS = {"fastspeech2": FastSpeech2}


class Trainer:
    def __init__(self, cfg, args):
        self.model = MODELS[args.arch](cfg)
        self.model.cuda()
        self.use_amp = args.amp
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        self.l1 = nn.L1Loss()
        self.grad_clip = args.grad_clip
        self.step = 0

    def train_step(self, batch):
        b = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            out = self.model(b["text"], b["text_len"], b["mel"], b["mel_len"], b["dur"], b["pitch"], b["energy"])
            keep = ~get_mask_from_lengths(b["text_len"], b["text"].size(1))
            log_dur_tgt = torch.log(b["dur"].float() + 1.0)
            dur_loss = F.mse_loss(out.log_dur.masked_select(keep), log_dur_tgt.masked_select(keep))
            pitch_loss = F.mse_loss(out.pitch.masked_select(keep), b["pitch"].masked_select(keep))
            energy_loss = F.mse_loss(out.energy.masked_select(keep), b["energy"].masked_select(keep))
            vuv_prob = torch.sigmoid(out.vuv_logit).masked_select(keep)
            vuv_loss = F.binary_cross_entropy(vuv_prob, b["vuv"].masked_select(keep))  # expect: AMP003
            pitch_spread = out.pitch.detach().std()  # expect: AMP004
        frame_keep = (~out.mel_mask).unsqueeze(-1)
        mel_pred = out.mel_post.masked_select(frame_keep)
        mel_loss = self.l1(mel_pred, b["mel"].masked_select(frame_keep))  # expect: AMP002
        mel_loss_pre = self.l1(out.mel.float().masked_select(frame_keep), b["mel"].masked_select(frame_keep))
        loss = mel_loss + mel_loss_pre + dur_loss + pitch_loss + energy_loss + 0.1 * vuv_loss
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        return {"loss": loss.item(), "mel": mel_loss.item(), "grad_norm": float(grad_norm), "pitch_spread": pitch_spread.item()}

    def fit(self, loader, total_steps, log_every=100):
        while self.step < total_steps:
            for batch in loader:
                stats = self.train_step(batch)
                if self.step % log_every == 0:
                    print(" ".join(f"{k}={v:.4f}" for k, v in stats.items()))
                if self.step >= total_steps:
                    break


def fake_batch(cfg, bsz=8, t_text=40):
    text_len = torch.randint(t_text // 2, t_text, (bsz,))
    dur = torch.randint(1, 6, (bsz, t_text)) * (torch.arange(t_text)[None] < text_len[:, None])
    mel_len = dur.sum(1)
    t_mel = int(mel_len.max())
    return {
        "text": torch.randint(1, cfg.n_symbols, (bsz, t_text)), "text_len": text_len, "dur": dur,
        "mel": torch.randn(bsz, t_mel, cfg.n_mels), "mel_len": mel_len,
        "pitch": torch.randn(bsz, t_text), "energy": torch.randn(bsz, t_text),
        "vuv": (torch.rand(bsz, t_text) > 0.3).float(),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="fastspeech2")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", dest="grad_clip", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=200000)
    args = p.parse_args()
    cfg = argparse.Namespace(n_symbols=80, dim=256, max_len=2000, enc_layers=4, dec_layers=6, n_mels=80, n_bins=256)
    loader = [fake_batch(cfg) for _ in range(50)]
    Trainer(cfg, args).fit(loader, args.steps)


if __name__ == "__main__":
    main()
