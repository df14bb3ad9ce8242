"""Conformer-CTC ASR with an utterance-level language-ID head (ESPnet / NeMo layout).

The log-mel frontend runs inside the model, attention classes are picked by name,
and the LID head pools encoder frames through an abstract ``AbsPooling`` whose
``forward`` calls the ``pool`` hook the subclasses implement.
"""
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ASRConfig:
    n_mels: int = 80
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 12
    ff_mult: int = 4
    conv_kernel: int = 31
    attn_type: str = "rel"  # key of ATTENTIONS
    vocab_size: int = 5000
    n_langs: int = 0  # > 0 adds the language-ID head
    lid_pool: str = "meanstd"  # key of POOLINGS
    lid_weight: float = 0.3
    dropout: float = 0.1


def _mel_filterbank(sample_rate, n_fft, n_mels, fmin=0.0, fmax=None):
    fmax = fmax or sample_rate / 2
    mels = torch.linspace(2595.0 * math.log10(1.0 + fmin / 700.0), 2595.0 * math.log10(1.0 + fmax / 700.0), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lower = (bins[None, :] - hz[:-2, None]) / (hz[1:-1, None] - hz[:-2, None])
    upper = (hz[2:, None] - bins[None, :]) / (hz[2:, None] - hz[1:-1, None])
    return torch.clamp(torch.minimum(lower, upper), min=0.0)


class LogMelFrontend(nn.Module):
    def __init__(self, sample_rate=16000, n_fft=512, win_length=400, hop_length=160, n_mels=80):
        super().__init__()
        self.n_fft, self.win_length, self.hop_length = n_fft, win_length, hop_length
        self.register_buffer("window", torch.hann_window(win_length), persistent=False)
        self.register_buffer("mel_fb", _mel_filterbank(sample_rate, n_fft, n_mels), persistent=False)

    def forward(self, wav, wav_lens):
        spec = torch.stft(wav, self.n_fft, hop_length=self.hop_length, win_length=self.win_length,
                          window=self.window, return_complex=True)
        power = spec.abs().pow(2.0)
        mel = torch.matmul(self.mel_fb, power)
        logmel = torch.log(mel + 1e-10)  # expect: AMP011
        # per-feature normalisation over time (NeMo "per_feature")
        mean = logmel.mean(dim=-1, keepdim=True)
        std = logmel.std(dim=-1, keepdim=True)
        feats = (logmel - mean) / (std + 1e-5)
        return feats.transpose(1, 2), wav_lens // self.hop_length + 1


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, mask):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        return self.out(x.transpose(1, 2).reshape(b, t, c * f)), mask[:, :, :-2:2][:, :, :-2:2]


class RelPositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pos = torch.arange(max_len - 1, -max_len, -1.0).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe = torch.zeros(2 * max_len - 1, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)
        self.max_len = max_len

    def forward(self, x):
        T = x.size(1)
        return self.pe[:, self.max_len - T: self.max_len + T - 1].to(x.dtype)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k, self.h = n_feat // n_head, n_head
        self.linear_q, self.linear_k = nn.Linear(n_feat, n_feat), nn.Linear(n_feat, n_feat)
        self.linear_v, self.linear_out = nn.Linear(n_feat, n_feat), nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(dropout_rate)

    def forward_qkv(self, query, key, value):
        b = query.size(0)
        q = self.linear_q(query).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(b, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)
            min_value = torch.finfo(scores.dtype).min
            attn = torch.softmax(scores.masked_fill(mask, min_value), dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.dropout(attn), value)
        return self.linear_out(x.transpose(1, 2).reshape(value.size(0), -1, self.h * self.d_k))

    def forward(self, query, key, value, mask, pos_emb=None):
        q, k, v = self.forward_qkv(query, key, value)
        return self.forward_attention(v, torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k), mask)


class RelPositionMultiHeadedAttention(MultiHeadedAttention):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__(n_head, n_feat, dropout_rate)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))

    @staticmethod
    def rel_shift(x):
        b, h, t1, t2 = x.size()
        x = F.pad(x, (1, 0)).view(b, h, t2 + 1, t1)[:, :, 1:].view(b, h, t1, t2)
        return x[:, :, :, : t2 // 2 + 1]

    def forward(self, query, key, value, mask, pos_emb=None):
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)
        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        matrix_ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        matrix_bd = self.rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        return self.forward_attention(v, (matrix_ac + matrix_bd) / math.sqrt(self.d_k), mask)


ATTENTIONS = {"abs": MultiHeadedAttention, "rel": RelPositionMultiHeadedAttention}


class ConvolutionModule(nn.Module):
    def __init__(self, channels, kernel_size):
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(channels, 2 * channels, 1)
        self.depthwise_conv = nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2, groups=channels)
        self.norm = nn.BatchNorm1d(channels)
        self.pointwise_conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        x = F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)
        x = F.silu(self.norm(self.depthwise_conv(x)))
        return self.pointwise_conv2(x).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, cfg: ASRConfig):
        super().__init__()
        d = cfg.d_model
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.ff_mult * d), nn.SiLU(), nn.Linear(cfg.ff_mult * d, d))
        self.norm_mha = nn.LayerNorm(d)
        self.self_attn = ATTENTIONS[cfg.attn_type](cfg.n_heads, d, cfg.dropout)
        self.norm_conv = nn.LayerNorm(d)
        self.conv = ConvolutionModule(d, cfg.conv_kernel)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.ff_mult * d), nn.SiLU(), nn.Linear(cfg.ff_mult * d, d))
        self.norm_final = nn.LayerNorm(d)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mask, pos_emb):
        x = x + 0.5 * self.dropout(self.ff1(x))
        xn = self.norm_mha(x)
        x = x + self.dropout(self.self_attn(xn, xn, xn, mask, pos_emb))
        x = x + self.dropout(self.conv(self.norm_conv(x)))
        x = x + 0.5 * self.dropout(self.ff2(x))
        return self.norm_final(x)


class ConformerEncoder(nn.Module):
    def __init__(self, cfg: ASRConfig):
        super().__init__()
        self.embed = Conv2dSubsampling(cfg.n_mels, cfg.d_model)
        self.pos_enc = RelPositionalEncoding(cfg.d_model)
        self.encoders = nn.ModuleList([ConformerBlock(cfg) for _ in range(cfg.n_layers)])

    def forward(self, feats, feat_lens):
        mask = (torch.arange(feats.size(1), device=feats.device)[None] < feat_lens[:, None]).unsqueeze(1)
        x, mask = self.embed(feats, mask)
        pos_emb = self.pos_enc(x)
        for layer in self.encoders:
            x = layer(x, mask, pos_emb)
        return x, mask.squeeze(1).sum(-1), mask


class AbsPooling(nn.Module, ABC):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim)

    def forward(self, x, mask: Optional[torch.Tensor] = None):
        h = self.proj(x)
        return self.pool(h, mask)

    @abstractmethod
    def pool(self, h, mask):
        ...


class MeanStdPooling(AbsPooling):
    def pool(self, h, mask):
        if mask is None:
            mu = h.mean(dim=1)  # expect: AMP004
            sd = h.std(dim=1)  # expect: AMP004
            return torch.cat([mu, sd], dim=-1)
        m = mask.unsqueeze(-1).to(h.dtype)
        n = m.sum(dim=1).clamp(min=1.0)
        mu = (h * m).sum(dim=1) / n
        var = ((h - mu.unsqueeze(1)) * m).pow(2).sum(dim=1) / n
        return torch.cat([mu, var.clamp(min=1e-5).sqrt()], dim=-1)


class MaxPooling(AbsPooling):
    def pool(self, h, mask):
        if mask is not None:
            h = h.masked_fill(~mask.unsqueeze(-1), -1e9)  # expect: AMP007
        return h.amax(dim=1)


class AttentivePooling(AbsPooling):
    def __init__(self, in_dim, out_dim):
        super().__init__(in_dim, out_dim)
        self.score = nn.Linear(out_dim, 1)

    def pool(self, h, mask):
        logits = self.score(torch.tanh(h)).squeeze(-1)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        w = logits.softmax(dim=-1)
        return (h * w.unsqueeze(-1)).sum(dim=1)


POOLINGS = {"meanstd": MeanStdPooling, "max": MaxPooling, "attentive": AttentivePooling}


class LIDHead(nn.Module):
    def __init__(self, d_model, n_langs, pooling="meanstd"):
        super().__init__()
        self.pooling = POOLINGS[pooling](d_model, d_model)
        self.classifier = nn.Linear(2 * d_model if pooling == "meanstd" else d_model, n_langs)

    def forward(self, enc, mask):
        return self.classifier(self.pooling(enc, mask))


ASROutput = NamedTuple("ASROutput", [("loss", torch.Tensor), ("loss_ctc", torch.Tensor), ("loss_lid", Optional[torch.Tensor])])


class ASRModel(nn.Module):
    def __init__(self, cfg: ASRConfig):
        super().__init__()
        self.frontend = LogMelFrontend(n_mels=cfg.n_mels)
        self.encoder = ConformerEncoder(cfg)
        self.ctc_lo = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.lid_head = LIDHead(cfg.d_model, cfg.n_langs, cfg.lid_pool) if cfg.n_langs else None
        self.lid_weight = cfg.lid_weight

    def forward(self, wav, wav_lens, tokens, token_lens, lang=None) -> ASROutput:
        feats, feat_lens = self.frontend(wav, wav_lens)
        enc, enc_lens, mask = self.encoder(feats, feat_lens)
        log_probs = self.ctc_lo(enc).log_softmax(dim=-1)
        loss_ctc = F.ctc_loss(log_probs.transpose(0, 1), tokens, enc_lens, token_lens, reduction="sum",
                              zero_infinity=True) / wav.size(0)
        loss_lid = None
        if self.lid_head is not None and lang is not None:
            loss_lid = F.cross_entropy(self.lid_head(enc, mask.squeeze(1)), lang)
            return ASROutput(loss_ctc + self.lid_weight * loss_lid, loss_ctc, loss_lid)
        return ASROutput(loss_ctc, loss_ctc, loss_lid)


def train_epoch(model, loader, optimizer, scheduler, scaler, device, accum_grad=4, grad_clip=5.0):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for i, batch in enumerate(loader):
        wav, wav_lens, tokens, token_lens, lang = (t.to(device, non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(wav, wav_lens, tokens, token_lens, lang)
            loss = out.loss / accum_grad
        scaler.scale(loss).backward()
        if (i + 1) % accum_grad != 0:
            continue
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if torch.isfinite(grad_norm):
            scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


@torch.inference_mode()
def greedy_decode(model, wav, wav_lens, blank=0):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        feats, feat_lens = model.frontend(wav, wav_lens)
        enc, enc_lens, _ = model.encoder(feats, feat_lens)
        best = model.ctc_lo(enc).argmax(dim=-1)
    return [[t for t in torch.unique_consecutive(seq[:n]).tolist() if t != blank] for seq, n in zip(best, enc_lens)]


def main(cfg: ASRConfig, loader, epochs=100, device="cuda"):
    model = ASRModel(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=epochs * len(loader))
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        train_epoch(model, loader, optimizer, scheduler, scaler, device)
    return model
