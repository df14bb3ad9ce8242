"""End-to-end text-to-waveform training (FastSpeech-style encoder + HiFi-GAN decoder)
with a multi-period discriminator, trained on random segments like VITS/JETS.

    python train_e2e.py --config configs/ljs_e2e.json --checkpoint_path cp_e2e
"""
import argparse
import glob
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from librosa.filters import mel as librosa_mel_fn
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from tts_data import TextAudioDurationDataset, TextAudioDurationCollate

LRELU_SLOPE = 0.1


class AttrDict(dict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__ = self


# ------------------------------------------------------------------ text side
def sequence_mask(lengths, max_len):
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def sinusoid_table(length, channels, device):
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, channels, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / channels))
    table = torch.zeros(length, channels, device=device)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return table[None]


class MultiHeadAttention(nn.Module):
    def __init__(self, channels, n_heads, dropout=0.1):
        super().__init__()
        self.n_heads, self.d_k = n_heads, channels // n_heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.d_k).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(torch.softmax(scores, dim=-1))
        return self.proj(torch.matmul(attn, v).transpose(1, 2).reshape(b, t, c))


class FFTBlock(nn.Module):
    def __init__(self, channels, n_heads, kernel_size=9, dropout=0.1):
        super().__init__()
        self.attn = MultiHeadAttention(channels, n_heads, dropout)
        self.norm1 = nn.LayerNorm(channels)
        self.ffn = nn.Sequential(nn.Conv1d(channels, 4 * channels, kernel_size, padding=kernel_size // 2), nn.ReLU(),
                                 nn.Conv1d(4 * channels, channels, 1))
        self.norm2 = nn.LayerNorm(channels)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        x = self.norm1(x + self.drop(self.attn(x, pad_mask)))
        x = self.norm2(x + self.drop(self.ffn(x.transpose(1, 2)).transpose(1, 2)))
        return x.masked_fill(pad_mask.unsqueeze(-1), 0.0)


class TextEncoder(nn.Module):
    def __init__(self, n_vocab, channels, n_layers, n_heads):
        super().__init__()
        self.emb = nn.Embedding(n_vocab, channels, padding_idx=0)
        self.layers = nn.ModuleList([FFTBlock(channels, n_heads) for _ in range(n_layers)])

    def forward(self, tokens, pad_mask):
        x = self.emb(tokens) * math.sqrt(self.emb.embedding_dim)
        x = x + sinusoid_table(x.size(1), x.size(2), x.device)
        for layer in self.layers:
            x = layer(x, pad_mask)
        return x


class DurationPredictor(nn.Module):
    def __init__(self, channels, filter_channels=256, kernel_size=3, dropout=0.5):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, filter_channels, kernel_size, padding=kernel_size // 2)
        self.conv2 = nn.Conv1d(filter_channels, filter_channels, kernel_size, padding=kernel_size // 2)
        self.norm1, self.norm2 = nn.LayerNorm(filter_channels), nn.LayerNorm(filter_channels)
        self.proj = nn.Linear(filter_channels, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        h = self.drop(self.norm1(F.relu(self.conv1(x.transpose(1, 2))).transpose(1, 2)))
        h = self.drop(self.norm2(F.relu(self.conv2(h.transpose(1, 2))).transpose(1, 2)))
        return self.proj(h).squeeze(-1).masked_fill(pad_mask, 0.0)


def length_regulate(x, durations):
    frames = [torch.repeat_interleave(xi, di, dim=0) for xi, di in zip(x, durations)]
    lengths = torch.tensor([f.size(0) for f in frames], device=x.device)
    return nn.utils.rnn.pad_sequence(frames, batch_first=True).transpose(1, 2), lengths


def slice_segments(x, ids_str, segment_size):
    idx = ids_str[:, None] + torch.arange(segment_size, device=x.device)[None, :]
    return torch.gather(x, 2, idx[:, None, :].expand(-1, x.size(1), -1))


def rand_slice_segments(x, lengths, segment_size):
    ids_str_max = (lengths - segment_size + 1).clamp(min=1)
    ids_str = (torch.rand(x.size(0), device=x.device) * ids_str_max).long()
    return slice_segments(x, ids_str, segment_size), ids_str


# ------------------------------------------------------------------ waveform side
class ResBlock(nn.Module):
    def __init__(self, channels, kernel_size=3, dilations=(1, 3, 5)):
        super().__init__()
        self.convs = nn.ModuleList([
            weight_norm(nn.Conv1d(channels, channels, kernel_size, 1, dilation=d, padding=(kernel_size * d - d) // 2))
            for d in dilations
        ])

    def forward(self, x):
        for conv in self.convs:
            x = x + conv(F.leaky_relu(x, LRELU_SLOPE))
        return x


class Generator(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.conv_pre = weight_norm(nn.Conv1d(h.hidden_channels, h.upsample_initial_channel, 7, 1, padding=3))
        self.ups, self.resblocks = nn.ModuleList(), nn.ModuleList()
        ch = h.upsample_initial_channel
        for u, k in zip(h.upsample_rates, h.upsample_kernel_sizes):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch, ch // 2, k, u, padding=(k - u) // 2)))
            ch //= 2
            self.resblocks.append(ResBlock(ch))
        self.conv_post = weight_norm(nn.Conv1d(ch, 1, 7, 1, padding=3))

    def forward(self, x):
        x = self.conv_pre(x)
        for up, block in zip(self.ups, self.resblocks):
            x = block(up(F.leaky_relu(x, LRELU_SLOPE)))
        return torch.tanh(self.conv_post(F.leaky_relu(x)))


class JointTTS(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.encoder = TextEncoder(h.n_vocab, h.hidden_channels, h.n_layers, h.n_heads)
        self.duration_predictor = DurationPredictor(h.hidden_channels)
        self.decoder = Generator(h)

    def forward(self, tokens, token_lens, durations, segment_frames):
        pad_mask = ~sequence_mask(token_lens, tokens.size(1))
        x = self.encoder(tokens, pad_mask)
        log_dur_pred = self.duration_predictor(x.detach(), pad_mask)
        frames, frame_lens = length_regulate(x, durations)
        segments, ids_slice = rand_slice_segments(frames, frame_lens, segment_frames)
        return self.decoder(segments), log_dur_pred, ids_slice, pad_mask


class DiscriminatorP(nn.Module):
    def __init__(self, period, kernel_size=5, stride=3):
        super().__init__()
        self.period = period
        chans = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList([
            nn.Conv2d(chans[i], chans[i + 1], (kernel_size, 1), (stride, 1), padding=(2, 0)) for i in range(4)
        ])
        self.convs.append(nn.Conv2d(1024, 1024, (kernel_size, 1), 1, padding=(2, 0)))
        self.conv_post = nn.Conv2d(1024, 1, (3, 1), 1, padding=(1, 0))

    def forward(self, x):
        fmap = []
        b, c, t = x.shape
        if t % self.period != 0:
            n_pad = self.period - (t % self.period)
            x = F.pad(x, (0, n_pad), "reflect")
            t = t + n_pad
        x = x.view(b, c, t // self.period, self.period)
        for conv in self.convs:
            x = F.leaky_relu(conv(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discriminators = nn.ModuleList([DiscriminatorP(p) for p in periods])

    def forward(self, y, y_hat):
        y_d_rs, y_d_gs, fmap_rs, fmap_gs = [], [], [], []
        for d in self.discriminators:
            y_d_r, fmap_r = d(y)
            y_d_g, fmap_g = d(y_hat)
            y_d_rs.append(y_d_r)
            fmap_rs.append(fmap_r)
            y_d_gs.append(y_d_g)
            fmap_gs.append(fmap_g)
        return y_d_rs, y_d_gs, fmap_rs, fmap_gs


# ------------------------------------------------------------------ losses / features
def feature_loss(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += torch.mean(torch.abs(rl - gl))  # expect: AMP004
    return loss * 2


def discriminator_loss(disc_real_outputs, disc_generated_outputs):
    loss = 0
    for dr, dg in zip(disc_real_outputs, disc_generated_outputs):
        loss += torch.mean((1 - dr) ** 2) + torch.mean(dg ** 2)
    return loss


def generator_loss(disc_outputs):
    return sum(torch.mean((1 - dg) ** 2) for dg in disc_outputs)


_mel_basis, _hann_window = {}, {}


def mel_spectrogram(y, h):
    key = f"{h.fmax}_{y.device}"
    if key not in _mel_basis:
        mel = librosa_mel_fn(sr=h.sampling_rate, n_fft=h.n_fft, n_mels=h.num_mels, fmin=h.fmin, fmax=h.fmax)
        _mel_basis[key] = torch.from_numpy(mel).float().to(y.device)
        _hann_window[str(y.device)] = torch.hann_window(h.win_size).to(y.device)
    pad = (h.n_fft - h.hop_size) // 2
    y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(y.float(), h.n_fft, hop_length=h.hop_size, win_length=h.win_size,
                      window=_hann_window[str(y.device)], center=False, return_complex=True)
    spec = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    return torch.log(torch.clamp(torch.matmul(_mel_basis[key], spec), min=1e-5))


# ------------------------------------------------------------------ training
def warmup_generator(generator, optim_g, loader, h, device, n_steps):
    """Mel + duration losses only (no adversarial terms) for the first steps."""
    scaler = torch.amp.GradScaler("cuda", enabled=h.fp16_run)
    step = 0
    while step < n_steps:
        for batch in loader:
            tokens, token_lens, durations, y, _ = [t.to(device, non_blocking=True) for t in batch]
            with torch.autocast("cuda", dtype=torch.float16, enabled=h.fp16_run):
                y_g_hat, log_dur_pred, ids_slice, pad_mask = generator(tokens, token_lens, durations, h.segment_frames)
                y = slice_segments(y, ids_slice * h.hop_size, h.segment_size)
                loss_mel = F.l1_loss(mel_spectrogram(y.squeeze(1), h), mel_spectrogram(y_g_hat.squeeze(1), h))
                loss_dur = F.mse_loss(log_dur_pred[~pad_mask], torch.log1p(durations.float())[~pad_mask])
                loss = h.lambda_mel * loss_mel + loss_dur
            optim_g.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optim_g)
            torch.nn.utils.clip_grad_norm_(generator.parameters(), 1000.0)
            scaler.step(optim_g)  # expect: AMP006
            step += 1
            if step >= n_steps:
                break


def scan_checkpoint(cp_dir, prefix):
    cp_list = sorted(glob.glob(os.path.join(cp_dir, prefix + "????????")))
    return cp_list[-1] if cp_list else None


def train(h, args):
    device = torch.device("cuda")
    generator = JointTTS(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(mpd.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    scaler = torch.cuda.amp.GradScaler(enabled=h.fp16_run)  # expect: AMP009

    steps, last_epoch = 0, -1
    cp = scan_checkpoint(args.checkpoint_path, "state_")
    if cp is not None:
        state = torch.load(cp, map_location=device)
        generator.load_state_dict(state["generator"])
        mpd.load_state_dict(state["mpd"])
        optim_g.load_state_dict(state["optim_g"])
        optim_d.load_state_dict(state["optim_d"])
        scaler.load_state_dict(state["scaler"])
        steps, last_epoch = state["steps"] + 1, state["epoch"]
    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    train_loader = DataLoader(TextAudioDurationDataset(h.training_files, h), batch_size=h.batch_size, shuffle=True,
                              num_workers=h.num_workers, collate_fn=TextAudioDurationCollate(), pin_memory=True,
                              drop_last=True)
    sw = SummaryWriter(os.path.join(args.checkpoint_path, "logs"))
    if steps == 0 and h.mel_warmup_steps > 0:
        warmup_generator(generator, optim_g, train_loader, h, device, h.mel_warmup_steps)

    generator.train()
    mpd.train()
    for epoch in range(max(0, last_epoch), args.training_epochs):
        start = time.time()
        for batch in train_loader:
            tokens, token_lens, durations, y, _ = [t.to(device, non_blocking=True) for t in batch]
            with torch.cuda.amp.autocast(enabled=h.fp16_run):  # expect: AMP009
                y_g_hat, log_dur_pred, ids_slice, pad_mask = generator(tokens, token_lens, durations, h.segment_frames)
                y = slice_segments(y, ids_slice * h.hop_size, h.segment_size)
                y_mel = mel_spectrogram(y.squeeze(1), h)
                y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h)

                y_df_hat_r, y_df_hat_g, _, _ = mpd(y, y_g_hat.detach())
                loss_disc = discriminator_loss(y_df_hat_r, y_df_hat_g)
                optim_d.zero_grad(set_to_none=True)
                scaler.scale(loss_disc).backward()  # expect: AMP008
            scaler.unscale_(optim_d)
            grad_norm_d = torch.nn.utils.clip_grad_norm_(mpd.parameters(), 1000.0)
            scaler.step(optim_d)

            with torch.cuda.amp.autocast(enabled=h.fp16_run):  # expect: AMP009
                _, y_df_hat_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
                loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * h.lambda_mel
                loss_fm = feature_loss(fmap_f_r, fmap_f_g)
                loss_gen = generator_loss(y_df_hat_g)
            log_dur_target = torch.log1p(durations.float())
            loss_dur = F.mse_loss(log_dur_pred[~pad_mask], log_dur_target[~pad_mask])  # expect: AMP002
            loss_gen_all = loss_gen + loss_fm + loss_mel + loss_dur

            optim_g.zero_grad(set_to_none=True)
            scaler.scale(loss_gen_all).backward()
            scaler.unscale_(optim_g)
            grad_norm_g = torch.nn.utils.clip_grad_norm_(generator.parameters(), 1000.0)
            scaler.step(optim_g)
            scaler.update()

            if steps % h.summary_interval == 0:
                sw.add_scalar("loss/g_total", loss_gen_all.item(), steps)
                sw.add_scalar("loss/mel", loss_mel.item() / h.lambda_mel, steps)
                sw.add_scalar("loss/dur", loss_dur.item(), steps)
                sw.add_scalar("loss/d", loss_disc.item(), steps)
                sw.add_scalar("grad/g", grad_norm_g.item(), steps)
                sw.add_scalar("grad/d", grad_norm_d.item(), steps)
                sw.add_scalar("amp/scale", scaler.get_scale(), steps)
            if steps % h.checkpoint_interval == 0 and steps != 0:
                torch.save({"generator": generator.state_dict(), "mpd": mpd.state_dict(),
                            "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                            "scaler": scaler.state_dict(), "steps": steps, "epoch": epoch},
                           os.path.join(args.checkpoint_path, f"state_{steps:08d}"))
            steps += 1
        scheduler_g.step()
        scheduler_d.step()
        print(f"epoch {epoch + 1} took {int(time.time() - start)}s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint_path", default="cp_e2e")
    parser.add_argument("--training_epochs", type=int, default=3100)
    args = parser.parse_args()
    with open(args.config) as f:
        h = AttrDict(json.load(f))
    h.setdefault("mel_warmup_steps", 0)
    os.makedirs(args.checkpoint_path, exist_ok=True)
    torch.manual_seed(h.seed)
    torch.backends.cudnn.benchmark = True
    train(h, args)


if __name__ == "__main__":
    main()
