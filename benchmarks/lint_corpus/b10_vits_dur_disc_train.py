# VITS2-style end-to-end TTS training: generator, multi-period discriminator and a
# duration discriminator, all sharing one GradScaler. Single-GPU version of train_ms.py.
import argparse
import json
import math
import os

import numpy as np
import torch as th
import torch.nn.functional as F
from torch import nn


def sequence_mask(length, max_length=None):
    max_length = max_length or int(length.max())
    x = th.arange(max_length, dtype=length.dtype, device=length.device)
    return x.unsqueeze(0) < length.unsqueeze(1)


def slice_segments(x, ids_str, segment_size):
    ret = th.zeros_like(x[:, :, :segment_size])
    for i in range(x.size(0)):
        ret[i] = x[i, :, ids_str[i]: ids_str[i] + segment_size]
    return ret


class MultiHeadAttention(nn.Module):
    def __init__(self, channels, n_heads, p_dropout=0.1):
        super().__init__()
        self.n_heads, self.k_channels = n_heads, channels // n_heads
        self.conv_qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)
        self.drop = nn.Dropout(p_dropout)

    def forward(self, x, attn_mask):
        b, d, t = x.shape
        q, k, v = (h.view(b, self.n_heads, self.k_channels, t).transpose(2, 3) for h in self.conv_qkv(x).chunk(3, dim=1))
        scores = th.matmul(q / math.sqrt(self.k_channels), k.transpose(-2, -1))
        scores = scores.masked_fill(attn_mask == 0, -1e4)
        p_attn = self.drop(F.softmax(scores, dim=-1))
        out = th.matmul(p_attn, v).transpose(2, 3).contiguous().view(b, d, t)
        return self.conv_o(out)


class TextEncoder(nn.Module):
    def __init__(self, n_vocab, out_channels, hidden, n_heads=2, n_layers=6):
        super().__init__()
        self.emb = nn.Embedding(n_vocab, hidden)
        nn.init.normal_(self.emb.weight, 0.0, hidden ** -0.5)
        self.attn = nn.ModuleList(MultiHeadAttention(hidden, n_heads) for _ in range(n_layers))
        self.norm = nn.ModuleList(nn.GroupNorm(1, hidden) for _ in range(n_layers))
        self.proj = nn.Conv1d(hidden, out_channels * 2, 1)
        self.out_channels = out_channels

    def forward(self, x, x_lengths):
        x = self.emb(x).transpose(1, 2) * math.sqrt(self.emb.embedding_dim)
        x_mask = sequence_mask(x_lengths, x.size(2)).unsqueeze(1).to(x.dtype)
        attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1)
        for attn, norm in zip(self.attn, self.norm):
            x = norm(x + attn(x * x_mask, attn_mask))
        stats = self.proj(x) * x_mask
        m, logs = th.split(stats, self.out_channels, dim=1)
        return x, m, logs, x_mask


class RefEncoder(nn.Module):
    """Global speaker/style vector from the reference spectrogram (no speaker ids)."""

    def __init__(self, spec_channels, gin_channels):
        super().__init__()
        chans = [spec_channels, 256, 256, 256]
        self.convs = nn.ModuleList(nn.Conv1d(chans[i], chans[i + 1], 5, padding=2) for i in range(3))
        self.proj = nn.Conv1d(256, gin_channels, 1)

    def forward(self, spec):
        x = spec
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
        x = self.proj(x)
        return x.mean(dim=-1, keepdim=True)  # expect: AMP004


class PosteriorEncoder(nn.Module):
    def __init__(self, in_channels, out_channels, hidden, gin_channels):
        super().__init__()
        self.pre, self.cond = nn.Conv1d(in_channels, hidden, 1), nn.Conv1d(gin_channels, hidden, 1)
        self.layers = nn.ModuleList(nn.Conv1d(hidden, hidden, 5, padding=2) for _ in range(8))
        self.proj = nn.Conv1d(hidden, out_channels * 2, 1)
        self.out_channels = out_channels

    def forward(self, x, x_lengths, g):
        x_mask = sequence_mask(x_lengths, x.size(2)).unsqueeze(1).to(x.dtype)
        x = self.pre(x) * x_mask + self.cond(g)
        for layer in self.layers:
            x = x + th.tanh(layer(x)) * x_mask
        m, logs = th.split(self.proj(x) * x_mask, self.out_channels, dim=1)
        z = (m + th.randn_like(m) * th.exp(logs)) * x_mask
        return z, m, logs, x_mask


class Generator(nn.Module):
    def __init__(self, in_channels, gin_channels, upsample_rates=(8, 8, 2, 2), ch=256):
        super().__init__()
        self.conv_pre = nn.Conv1d(in_channels, ch, 7, padding=3)
        self.cond = nn.Conv1d(gin_channels, ch, 1)
        self.ups = nn.ModuleList()
        for i, u in enumerate(upsample_rates):
            self.ups.append(nn.ConvTranspose1d(ch // 2 ** i, ch // 2 ** (i + 1), u * 2, u, padding=u // 2))
        self.conv_post = nn.Conv1d(ch // 2 ** len(upsample_rates), 1, 7, padding=3)

    def forward(self, z, g):
        x = self.conv_pre(z) + self.cond(g)
        for up in self.ups:
            x = up(F.leaky_relu(x, 0.1))
        return th.tanh(self.conv_post(F.leaky_relu(x)))


def maximum_path(neg_cent, mask):
    """Monotonic alignment search (the cython kernel, in numpy; batch loop on the CPU)."""
    value = neg_cent.detach().float().cpu().numpy()
    mask_np = mask.cpu().numpy().astype(bool)
    value[~mask_np] = -1e9
    path = np.zeros_like(value, dtype=np.int32)
    for i in range(value.shape[0]):
        ty, tx = int(mask_np[i, :, 0].sum()), int(mask_np[i, 0].sum())
        v = value[i]
        for y in range(1, ty):
            v[y, 1:tx] += np.maximum(v[y - 1, 1:tx], v[y - 1, : tx - 1])
            v[y, 0] += v[y - 1, 0]
        index = tx - 1
        for y in range(ty - 1, -1, -1):
            path[i, y, index] = 1
            if index != 0 and (index == y or v[y - 1, index] < v[y - 1, index - 1]):
                index -= 1
    return th.from_numpy(path).to(device=neg_cent.device, dtype=neg_cent.dtype)


class SynthesizerTrn(nn.Module):
    def __init__(self, n_vocab, spec_channels, segment_frames, inter=192, hidden=192, gin=256):
        super().__init__()
        self.segment_frames = segment_frames
        self.enc_p = TextEncoder(n_vocab, inter, hidden)
        self.enc_q = PosteriorEncoder(spec_channels, inter, hidden, gin)
        self.ref_enc = RefEncoder(spec_channels, gin)
        self.dec = Generator(inter, gin)
        self.dp = nn.Sequential(nn.Conv1d(hidden, 256, 3, padding=1), nn.ReLU(), nn.Conv1d(256, 1, 1))

    def forward(self, x, x_lengths, spec, spec_lengths):
        hidden_x, m_p, logs_p, x_mask = self.enc_p(x, x_lengths)
        g = self.ref_enc(spec)
        z, m_q, logs_q, y_mask = self.enc_q(spec, spec_lengths, g)
        z_p = z
        with th.no_grad():
            s_p_sq_r = th.exp(-2 * logs_p)
            neg_cent1 = th.sum(-0.5 * math.log(2 * math.pi) - logs_p, [1], keepdim=True)
            neg_cent2 = th.matmul(-0.5 * (z_p ** 2).transpose(1, 2), s_p_sq_r)
            neg_cent3 = th.matmul(z_p.transpose(1, 2), m_p * s_p_sq_r)
            neg_cent4 = th.sum(-0.5 * (m_p ** 2) * s_p_sq_r, [1], keepdim=True)
            neg_cent = neg_cent1 + neg_cent2 + neg_cent3 + neg_cent4
            attn_mask = x_mask.unsqueeze(2) * y_mask.unsqueeze(-1)
            attn = maximum_path(neg_cent, attn_mask.squeeze(1)).unsqueeze(1)
        w = attn.sum(2)
        logw_ = th.log(w + 1e-6) * x_mask
        logw = self.dp(hidden_x.detach() * x_mask) * x_mask
        l_length = th.sum((logw - logw_) ** 2, [1, 2]) / th.sum(x_mask)
        m_p = th.matmul(attn.squeeze(1), m_p.transpose(1, 2)).transpose(1, 2)
        logs_p = th.matmul(attn.squeeze(1), logs_p.transpose(1, 2)).transpose(1, 2)
        ids_slice = th.randint(0, max(int(spec_lengths.min()) - self.segment_frames, 1), (x.size(0),), device=x.device)
        o = self.dec(slice_segments(z, ids_slice, self.segment_frames), g)
        return o, l_length, ids_slice, x_mask, y_mask, (z, z_p, m_p, logs_p, m_q, logs_q), (hidden_x, logw, logw_)


class DiscriminatorP(nn.Module):
    def __init__(self, period):
        super().__init__()
        self.period = period
        chans = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList(nn.Conv2d(chans[i], chans[i + 1], (5, 1), (3, 1), padding=(2, 0)) for i in range(4))
        self.conv_post = nn.Conv2d(1024, 1, (3, 1), 1, padding=(1, 0))

    def forward(self, x):
        b, c, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
        x, fmap = x.view(b, c, -1, self.period), []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            fmap.append(x)
        fmap.append(self.conv_post(x))
        return th.flatten(fmap[-1], 1, -1), fmap


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discriminators = nn.ModuleList(DiscriminatorP(p) for p in periods)

    def forward(self, y, y_hat):
        outs = [(d(y), d(y_hat)) for d in self.discriminators]
        return [r[0] for r, _ in outs], [g[0] for _, g in outs], [r[1] for r, _ in outs], [g[1] for _, g in outs]


class DurationDiscriminator(nn.Module):
    def __init__(self, in_channels, hidden=192):
        super().__init__()
        self.pre = nn.Conv1d(in_channels, hidden, 3, padding=1)
        self.dur_proj = nn.Conv1d(1, hidden, 1)
        self.out = nn.Sequential(nn.Conv1d(2 * hidden, hidden, 3, padding=1), nn.ReLU(), nn.Conv1d(hidden, 1, 1))

    def forward(self, x, x_mask, dur_r, dur_hat):
        x = th.relu(self.pre(x * x_mask))
        outs = []
        for dur in (dur_r, dur_hat):
            h = th.cat([x, self.dur_proj(dur)], dim=1)
            outs.append(th.sigmoid(self.out(h * x_mask)).mean(dim=-1))  # expect: AMP004
        return outs


def feature_loss(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += th.mean(th.abs(rl.float().detach() - gl.float()))
    return loss * 2


def discriminator_loss(disc_real_outputs, disc_generated_outputs):
    loss, r_losses, g_losses = 0, [], []
    for dr, dg in zip(disc_real_outputs, disc_generated_outputs):
        dr, dg = dr.float(), dg.float()
        r_loss, g_loss = th.mean((1 - dr) ** 2), th.mean(dg ** 2)
        loss += r_loss + g_loss
        r_losses.append(r_loss.item()), g_losses.append(g_loss.item())
    return loss, r_losses, g_losses


def generator_loss(disc_outputs):
    gen_losses = [th.mean((1 - dg.float()) ** 2) for dg in disc_outputs]
    return sum(gen_losses), gen_losses


def kl_loss(z_p, logs_q, m_p, logs_p, z_mask):
    z_p, logs_q, m_p, logs_p, z_mask = z_p.float(), logs_q.float(), m_p.float(), logs_p.float(), z_mask.float()
    kl = logs_p - logs_q - 0.5 + 0.5 * ((z_p - m_p) ** 2) * th.exp(-2.0 * logs_p)
    return th.sum(kl * z_mask) / th.sum(z_mask)


def mel_spectrogram(y, n_fft=1024, hop=256, mel_basis=None):
    window = th.hann_window(n_fft, device=y.device)
    spec = th.stft(y, n_fft, hop_length=hop, window=window, center=False, return_complex=True)
    spec = th.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-6)
    return th.log(th.clamp(th.matmul(mel_basis, spec), min=1e-5))


def train_and_evaluate(hps, nets, optims, scaler, loader, mel_basis, epoch):
    net_g, net_d, net_dur_disc = nets
    optim_g, optim_d, optim_dur_disc = optims
    for net in nets:
        net.train()
    for batch_idx, (x, x_lengths, spec, spec_lengths, y, y_lengths) in enumerate(loader):
        x, x_lengths = x.cuda(non_blocking=True), x_lengths.cuda(non_blocking=True)
        spec, spec_lengths = spec.cuda(non_blocking=True), spec_lengths.cuda(non_blocking=True)
        y = y.cuda(non_blocking=True)
        mel = th.log(th.clamp(th.matmul(mel_basis, spec), min=1e-5))

        with th.autocast("cuda", dtype=th.float16, enabled=hps.fp16):
            y_hat, l_length, ids_slice, x_mask, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q), (hidden_x, logw, logw_) = net_g(
                x, x_lengths, spec, spec_lengths)
            y_mel = slice_segments(mel, ids_slice, hps.segment_frames)
            y_hat_mel = mel_spectrogram(y_hat.squeeze(1).float(), mel_basis=mel_basis)
            y = slice_segments(y, ids_slice * hps.hop_length, hps.segment_frames * hps.hop_length)

            y_d_hat_r, y_d_hat_g, _, _ = net_d(y, y_hat.detach())
            y_dur_hat_r, y_dur_hat_g = net_dur_disc(hidden_x.detach(), x_mask.detach(), logw_.detach(), logw.detach())
            with th.autocast("cuda", enabled=False):
                loss_disc, losses_disc_r, losses_disc_g = discriminator_loss(y_d_hat_r, y_d_hat_g)
                loss_dur_disc, _, _ = discriminator_loss([y_dur_hat_r], [y_dur_hat_g])

        optim_dur_disc.zero_grad()
        scaler.scale(loss_dur_disc).backward()
        grad_norm_dur = th.nn.utils.clip_grad_norm_(net_dur_disc.parameters(), 5.0)  # expect: AMP005
        optim_dur_disc.step()  # expect: AMP006

        optim_d.zero_grad()
        scaler.scale(loss_disc).backward()
        scaler.unscale_(optim_d)
        grad_norm_d = th.nn.utils.clip_grad_norm_(net_d.parameters(), 100.0)
        scaler.step(optim_d)

        with th.autocast("cuda", dtype=th.float16, enabled=hps.fp16):
            y_d_hat_r, y_d_hat_g, fmap_r, fmap_g = net_d(y, y_hat)
            _, y_dur_hat_g = net_dur_disc(hidden_x, x_mask, logw_, logw)
            with th.autocast("cuda", enabled=False):
                loss_dur = th.sum(l_length.float())
                loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.c_mel
                loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.c_kl
                loss_fm = feature_loss(fmap_r, fmap_g)
                loss_gen, losses_gen = generator_loss(y_d_hat_g)
                loss_dur_gen, _ = generator_loss([y_dur_hat_g])
                loss_gen_all = loss_gen + loss_fm + loss_mel + loss_dur + loss_kl + loss_dur_gen
        optim_g.zero_grad()
        scaler.scale(loss_gen_all).backward()
        scaler.unscale_(optim_g)
        grad_norm_g = th.nn.utils.clip_grad_norm_(net_g.parameters(), 100.0)
        scaler.step(optim_g)
        scaler.update()

        if batch_idx % hps.log_interval == 0:
            print(f"epoch {epoch} [{batch_idx}] d={loss_disc.item():.3f} dur_d={loss_dur_disc.item():.3f} "
                  f"g={loss_gen_all.item():.3f} mel={loss_mel.item():.3f} |g|={grad_norm_g:.2f} |d|={grad_norm_d:.2f} "
                  f"|dd|={grad_norm_dur:.2f} scale={scaler.get_scale():.0f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", default="configs/vits2_ljs.json")
    parser.add_argument("-m", "--model_dir", default="logs/vits2_ljs")
    args = parser.parse_args()
    with open(args.config) as f:
        hps = argparse.Namespace(**json.load(f)["train"])
    os.makedirs(args.model_dir, exist_ok=True)

    net_g = SynthesizerTrn(hps.n_vocab, hps.spec_channels, hps.segment_frames).cuda()
    net_d = MultiPeriodDiscriminator().cuda()
    net_dur_disc = DurationDiscriminator(192).cuda()
    optim_g = th.optim.AdamW(net_g.parameters(), hps.learning_rate, betas=hps.betas, eps=hps.eps)
    optim_d = th.optim.AdamW(net_d.parameters(), hps.learning_rate, betas=hps.betas, eps=hps.eps)
    optim_dur_disc = th.optim.AdamW(net_dur_disc.parameters(), 3e-4, betas=hps.betas, eps=hps.eps)
    scaler = th.cuda.amp.GradScaler(enabled=hps.fp16)  # expect: AMP009
    mel_basis = th.from_numpy(np.load(hps.mel_basis_path)).float().cuda()
    loader = th.utils.data.DataLoader(th.load(hps.train_cache), batch_size=hps.batch_size, shuffle=True, num_workers=4)

    for epoch in range(1, hps.epochs + 1):
        train_and_evaluate(hps, (net_g, net_d, net_dur_disc), (optim_g, optim_d, optim_dur_disc), scaler, loader,
                           mel_basis, epoch)
        th.save({"model": net_g.state_dict(), "optimizer": optim_g.state_dict(), "epoch": epoch},
                os.path.join(args.model_dir, f"G_{epoch}.pth"))


if __name__ == "__main__":
    main()
