"""FastSpeech2-style acoustic model with a Conformer encoder and a variance adaptor.

Duration / pitch / energy predictors are trained on MFA durations and frame-level
pitch and energy averaged per phoneme.  A reference (prosody) encoder summarises the
target mel into an utterance embedding with statistics pooling.
"""
import argparse
import math
from contextlib import nullcontext
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class TTSOutput(NamedTuple):
    mel: torch.Tensor
    mel_postnet: torch.Tensor
    log_duration: torch.Tensor
    pitch: torch.Tensor
    energy: torch.Tensor
    utt_pitch: torch.Tensor


class FeedForward(nn.Module):
    def __init__(self, d, mult=4, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, d * mult)
        self.w2 = nn.Linear(d * mult, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.w2(self.drop(F.silu(self.w1(self.norm(x))))))


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d, heads, dropout=0.1):
        super().__init__()
        self.heads, self.dk = heads, d // heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, self.dk).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dk)
        scores = scores.masked_fill(~key_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, t, -1))


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channel axis of (B, C, T) tensors (ConvNeXt style)."""

    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None] * x + self.bias[:, None]


class ConvModule(nn.Module):
    def __init__(self, d, kernel=31):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.cln = ChannelLayerNorm(d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x, mask):
        h = self.norm(x).masked_fill(~mask.unsqueeze(-1), 0.0).transpose(1, 2)
        h = F.glu(self.pw1(h), dim=1)
        h = self.pw2(F.silu(self.cln(self.dw(h))))
        return h.transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d, heads, kernel):
        super().__init__()
        self.ff1, self.ff2 = FeedForward(d), FeedForward(d)
        self.mhsa = MultiHeadSelfAttention(d, heads)
        self.conv = ConvModule(d, kernel)
        self.final_norm = nn.LayerNorm(d)

    def forward(self, x, mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.mhsa(x, mask)
        x = x + self.conv(x, mask)
        x = x + 0.5 * self.ff2(x)
        return self.final_norm(x)


class VariancePredictor(nn.Module):
    def __init__(self, d, filt=256, kernel=3, dropout=0.5, utterance_stat=False):
        super().__init__()
        self.conv1 = nn.Conv1d(d, filt, kernel, padding=kernel // 2)
        self.ln1 = nn.LayerNorm(filt)
        self.conv2 = nn.Conv1d(filt, filt, kernel, padding=kernel // 2)
        self.ln2 = nn.LayerNorm(filt)
        self.proj = nn.Linear(filt, 1)
        self.utt_proj = nn.Linear(filt, 1) if utterance_stat else None
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        h = F.relu(self.conv1(x.transpose(1, 2))).transpose(1, 2)
        h = self.drop(self.ln1(h))
        h = F.relu(self.conv2(h.transpose(1, 2))).transpose(1, 2)
        h = self.drop(self.ln2(h))  # LayerNorm output: fp32 under CUDA autocast
        frame = self.proj(h).squeeze(-1).masked_fill(~mask, 0.0)
        if self.utt_proj is None:
            return frame, None
        # masked mean over an fp32 mask: promoted to fp32 before the sum
        m = mask.float().unsqueeze(-1)
        utt = (self.utt_proj(h) * m).sum(1) / m.sum(1).clamp(min=1.0)
        return frame, utt.squeeze(-1)


class StatsPool(nn.Module):
    def forward(self, h):
        mu = h.mean(dim=-1)  # expect: AMP004
        sigma = torch.sqrt(h.var(dim=-1) + 1e-8)  # expect: AMP004, AMP011
        return torch.cat([mu, sigma], dim=-1)


class AttentiveStatsPool(nn.Module):
    def __init__(self, c, bottleneck=128):
        super().__init__()
        self.attn = nn.Sequential(nn.Conv1d(c, bottleneck, 1), nn.Tanh(), nn.Conv1d(bottleneck, c, 1))

    def forward(self, h):
        w = torch.softmax(self.attn(h), dim=2)  # fp32 under CUDA autocast
        mu = torch.sum(h * w, dim=2)
        sg = torch.sqrt((torch.sum(h.pow(2) * w, dim=2) - mu.pow(2)).clamp(min=1e-8))
        return torch.cat([mu, sg], dim=-1)


class ReferenceEncoder(nn.Module):
    def __init__(self, n_mels, channels, d_out, attentive=False):
        super().__init__()
        self.convs = nn.ModuleList()
        c = n_mels
        for ch in channels:
            self.convs.append(nn.Conv1d(c, ch, 3, padding=1))
            c = ch
        self.pool = AttentiveStatsPool(c) if attentive else StatsPool()
        self.fc = nn.Linear(2 * c, d_out)

    def forward(self, mel):
        h = mel.transpose(1, 2)
        for conv in self.convs:
            h = F.relu(conv(h))
        return self.fc(self.pool(h))


def length_regulate(x, durations, max_len=None):
    out = [torch.repeat_interleave(xi, di, dim=0) for xi, di in zip(x, durations)]
    max_len = max_len or max(o.size(0) for o in out)
    return torch.stack([F.pad(o, (0, 0, 0, max_len - o.size(0))) for o in out])


class FastSpeech2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.embed = nn.Embedding(cfg["n_symbols"], d, padding_idx=0)
        self.encoder = nn.ModuleList([ConformerBlock(d, cfg["heads"], cfg["kernel"]) for _ in range(cfg["enc_layers"])])
        self.decoder = nn.ModuleList([ConformerBlock(d, cfg["heads"], cfg["kernel"]) for _ in range(cfg["dec_layers"])])
        self.ref_encoder = ReferenceEncoder(cfg["n_mels"], [128, 128, 256], d, attentive=cfg["attentive_pool"])
        self.duration_predictor = VariancePredictor(d)
        self.pitch_predictor = VariancePredictor(d, utterance_stat=True)
        self.energy_predictor = VariancePredictor(d)
        self.register_buffer("pitch_bins", torch.linspace(-3.0, 3.0, cfg["n_bins"] - 1))
        self.register_buffer("energy_bins", torch.linspace(-2.0, 4.0, cfg["n_bins"] - 1))
        self.pitch_embed = nn.Embedding(cfg["n_bins"], d)
        self.energy_embed = nn.Embedding(cfg["n_bins"], d)
        self.mel_linear = nn.Linear(d, cfg["n_mels"])
        layers = []
        c = cfg["n_mels"]
        for _ in range(4):
            layers += [nn.Conv1d(c, 512, 5, padding=2), nn.BatchNorm1d(512), nn.Tanh(), nn.Dropout(0.5)]
            c = 512
        layers.append(nn.Conv1d(c, cfg["n_mels"], 5, padding=2))
        self.postnet = nn.Sequential(*layers)

    def forward(self, phonemes, src_mask, mel, mel_mask, duration, pitch, energy):
        x = self.embed(phonemes)
        for block in self.encoder:
            x = block(x, src_mask)
        x = x + self.ref_encoder(mel).unsqueeze(1)
        log_dur, _ = self.duration_predictor(x, src_mask)
        pitch_pred, utt_pitch = self.pitch_predictor(x, src_mask)
        energy_pred, _ = self.energy_predictor(x, src_mask)
        # teacher forcing: embeddings of the ground-truth (fp32) variances
        x = x + self.pitch_embed(torch.bucketize(pitch, self.pitch_bins))
        x = x + self.energy_embed(torch.bucketize(energy, self.energy_bins))
        x = length_regulate(x, duration, max_len=mel.size(1))
        for block in self.decoder:
            x = block(x, mel_mask)
        mel_out = self.mel_linear(x)
        mel_post = mel_out + self.postnet(mel_out.transpose(1, 2)).transpose(1, 2)
        return TTSOutput(mel_out, mel_post, log_dur, pitch_pred, energy_pred, utt_pitch)


class FastSpeech2Loss(nn.Module):
    def forward(self, out, batch):
        src_mask, mel_mask = batch["src_mask"], batch["mel_mask"]
        mel_t = batch["mel"].masked_select(mel_mask.unsqueeze(-1))
        mel_loss = F.l1_loss(out.mel.masked_select(mel_mask.unsqueeze(-1)), mel_t)
        log_dur_t = torch.log(batch["duration"].float() + 1.0)
        dur_loss = F.mse_loss(out.log_duration.masked_select(src_mask), log_dur_t.masked_select(src_mask))
        pitch_loss = F.mse_loss(out.pitch.masked_select(src_mask), batch["pitch"].masked_select(src_mask))
        energy_loss = F.mse_loss(out.energy.masked_select(src_mask), batch["energy"].masked_select(src_mask))
        utt_loss = F.mse_loss(out.utt_pitch, batch["utt_pitch_mean"])
        total = mel_loss + dur_loss + pitch_loss + energy_loss + 0.1 * utt_loss
        return {"total": total, "mel": mel_loss, "dur": dur_loss, "pitch": pitch_loss, "energy": energy_loss}


def build_model(cfg):
    return FastSpeech2(cfg)


def train(args, cfg, loader):
    device = torch.device("cuda")
    model = build_model(cfg).to(device)
    if args.compile:
        model = torch.compile(model)
    criterion = FastSpeech2Loss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=args.steps, pct_start=0.05)
    ctx = torch.autocast(device_type="cuda", dtype=torch.float16) if args.amp else nullcontext()
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    step = 0
    while step < args.steps:
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with ctx:
                out = model(batch["phonemes"], batch["src_mask"], batch["mel"], batch["mel_mask"],
                            batch["duration"], batch["pitch"], batch["energy"])
                losses = criterion(out, batch)
            post_loss = F.l1_loss(out.mel_postnet, batch["mel"])  # expect: AMP002
            loss = losses["total"] + post_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            step += 1
            if step % 100 == 0:
                logs = {k: round(v.item(), 4) for k, v in losses.items()}
                print(step, logs, f"post={post_loss.item():.4f} gn={grad_norm.item():.2f}")
            if step >= args.steps:
                break
    return model


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--amp", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=200_000)
    a = p.parse_args()
    config = dict(d_model=256, heads=2, kernel=31, enc_layers=4, dec_layers=4, n_symbols=80,
                  n_mels=80, n_bins=256, attentive_pool=False)
    train(a, config, DataLoader([]))
