"""Conformer-CTC speech recogniser with a learnable front-end and relative positional self-attention."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LearnableFrontend(nn.Module):
    """Complex filterbank -> energy -> per-channel Gaussian low-pass -> log compression."""

    def __init__(self, n_filters=80, win=401, hop=160):
        super().__init__()
        self.hop = hop
        self.filterbank = nn.Conv1d(1, 2 * n_filters, win, padding=win // 2, bias=False)
        self.lowpass = nn.Conv1d(n_filters, n_filters, win, stride=hop, padding=win // 2,
                                 groups=n_filters, bias=False)
        with torch.no_grad():
            n = torch.arange(win, dtype=torch.float32) - win // 2
            window = torch.exp(-0.5 * (n / (0.4 * win / 2)) ** 2)
            self.lowpass.weight.copy_((window / window.sum()).expand(n_filters, 1, win))

    def forward(self, wav):
        x = self.filterbank(wav.unsqueeze(1))
        real, imag = x.chunk(2, dim=1)
        feats = self.lowpass(real * real + imag * imag)
        return torch.log(feats + 1e-10).transpose(1, 2)  # expect: AMP011


class SpecAugment(nn.Module):
    def __init__(self, freq_masks=2, freq_width=27, time_masks=10, time_width=0.05):
        super().__init__()
        self.freq_masks, self.freq_width = freq_masks, freq_width
        self.time_masks, self.time_width = time_masks, time_width

    def forward(self, x):
        B, T, Fdim = x.shape
        mask = torch.zeros(B, T, Fdim, dtype=torch.bool, device=x.device)
        for b in range(B):
            for _ in range(self.freq_masks):
                w = int(torch.randint(0, self.freq_width + 1, ()))
                f0 = int(torch.randint(0, max(1, Fdim - w), ()))
                mask[b, :, f0:f0 + w] = True
            for _ in range(self.time_masks):
                w = int(torch.randint(0, max(1, int(self.time_width * T)) + 1, ()))
                t0 = int(torch.randint(0, max(1, T - w), ()))
                mask[b, t0:t0 + w, :] = True
        return x.masked_fill(mask, 0.0)


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, lengths):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, ((lengths - 1) // 2 - 1) // 2


class RelPositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=3000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)
        pos = torch.arange(max_len - 1, -max_len, -1.0).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe = torch.zeros(2 * max_len - 1, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x):
        T = x.size(1)
        center = self.pe.size(1) // 2
        pos_emb = self.pe[:, center - T + 1: center + T]
        return self.dropout(x * self.xscale), self.dropout(pos_emb)


class RelPositionMultiHeadAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout=0.1):
        super().__init__()
        self.h, self.d_k = n_head, n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.dropout = nn.Dropout(dropout)

    @staticmethod
    def rel_shift(x):
        b, h, qlen, pos_len = x.size()
        zero_pad = torch.zeros((b, h, qlen, 1), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=-1).view(b, h, pos_len + 1, qlen)
        return x_padded[:, :, 1:].view_as(x)[:, :, :, : pos_len // 2 + 1]

    def forward(self, x, pos_emb, mask):
        B, T, _ = x.shape
        q = self.linear_q(x).view(B, T, self.h, self.d_k)
        k = self.linear_k(x).view(B, T, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(B, T, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_u, k.transpose(-2, -1))
        matrix_bd = self.rel_shift(torch.matmul(q_v, p.transpose(-2, -1)))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        scores = scores.masked_fill(mask, -1e9)  # expect: AMP007
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        x = torch.matmul(self.dropout(attn), v).transpose(1, 2).reshape(B, T, -1)
        return self.linear_out(x)


class FeedForward(nn.Module):
    def __init__(self, d_model, expansion=4, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(d_model), nn.Linear(d_model, expansion * d_model), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(expansion * d_model, d_model), nn.Dropout(dropout),
        )

    def forward(self, x):
        return self.net(x)


class ConvModule(nn.Module):
    def __init__(self, channels, kernel_size=31, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.pw1 = nn.Conv1d(channels, 2 * channels, 1)
        self.dw = nn.Conv1d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels)
        self.bn = nn.BatchNorm1d(channels)
        self.pw2 = nn.Conv1d(channels, channels, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        x = self.norm(x).transpose(1, 2)
        x = F.glu(self.pw1(x), dim=1).masked_fill(pad_mask[:, None, :], 0.0)
        x = F.silu(self.bn(self.dw(x)))
        return self.dropout(self.pw2(x)).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d_model, n_head, kernel_size=31, dropout=0.1):
        super().__init__()
        self.ff1 = FeedForward(d_model, dropout=dropout)
        self.norm_mha = nn.LayerNorm(d_model)
        self.mha = RelPositionMultiHeadAttention(n_head, d_model, dropout)
        self.conv = ConvModule(d_model, kernel_size, dropout)
        self.ff2 = FeedForward(d_model, dropout=dropout)
        self.norm_out = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pos_emb, att_mask, pad_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.dropout(self.mha(self.norm_mha(x), pos_emb, att_mask))
        x = x + self.conv(x, pad_mask)
        x = x + 0.5 * self.ff2(x)
        return self.norm_out(x)


class ConformerCTC(nn.Module):
    def __init__(self, vocab_size=256, n_mels=80, d_model=256, n_head=4, n_layers=12, hop=160):
        super().__init__()
        self.hop = hop
        self.frontend = LearnableFrontend(n_mels, hop=hop)
        self.specaug = SpecAugment()
        self.subsample = Conv2dSubsampling(n_mels, d_model)
        self.pos_enc = RelPositionalEncoding(d_model)
        self.blocks = nn.ModuleList([ConformerBlock(d_model, n_head) for _ in range(n_layers)])
        self.ctc_head = nn.Linear(d_model, vocab_size)

    def forward(self, wav, wav_lens):
        feats = self.frontend(wav)
        feats = feats - feats.mean(dim=1, keepdim=True)
        if self.training:
            feats = self.specaug(feats)
        x, lens = self.subsample(feats, wav_lens // self.hop + 1)
        x, pos_emb = self.pos_enc(x)
        pad_mask = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        for blk in self.blocks:
            x = blk(x, pos_emb, pad_mask[:, None, None, :], pad_mask)
        return self.ctc_head(x), lens


class CTCTrainer:
    def __init__(self, model_cfg, lr=1e-3, grad_clip=5.0, accum_steps=4, device="cuda"):
        self.device = device
        self.model = ConformerCTC(**model_cfg).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=1e-3)
        self.scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=True)
        self.grad_clip = grad_clip
        self.accum_steps = accum_steps

    def forward_backward(self, wav, wav_lens, targets, target_lens):
        with torch.autocast("cuda", dtype=torch.float16):
            logits, out_lens = self.model(wav, wav_lens)
        log_probs = logits.log_softmax(-1).transpose(0, 1)
        loss = self.ctc(log_probs, targets, out_lens, target_lens)  # expect: AMP002
        self.scaler.scale(loss / self.accum_steps).backward()
        return loss.detach()

    def optimizer_step(self):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def fit(self, loader, epochs=50):
        self.model.train()
        for epoch in range(epochs):
            for i, (wav, wav_lens, targets, target_lens) in enumerate(loader):
                wav, wav_lens = wav.to(self.device), wav_lens.to(self.device)
                loss = self.forward_backward(wav, wav_lens, targets, target_lens)
                if (i + 1) % self.accum_steps == 0:
                    grad_norm = self.optimizer_step()
                    if (i + 1) % (100 * self.accum_steps) == 0:
                        print(f"epoch {epoch} it {i + 1} loss {loss.item():.3f} grad {grad_norm:.2f}")

    @torch.no_grad()
    def greedy_decode(self, wav, wav_lens):
        self.model.eval()
        with torch.autocast("cuda", dtype=torch.float16):
            logits, lens = self.model(wav.to(self.device), wav_lens.to(self.device))
        best = logits.argmax(-1)
        hyps = []
        for seq, n in zip(best, lens):
            seq = torch.unique_consecutive(seq[:n])
            hyps.append(seq[seq != 0].tolist())
        self.model.train()
        return hyps
