"""Conformer-Transducer (RNN-T) acoustic model with an auxiliary CTC head.

Encoder: conv2d subsampling, relative-position MHSA, macaron feed-forward,
convolution module with squeeze-excitation, and one time-reduction layer in
the middle of the stack. Decoder: LSTM prediction network and joint network.
"""
import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader


@dataclass
class ConformerConfig:
    n_mels: int = 80
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 16
    ff_mult: int = 4
    conv_kernel: int = 31
    dropout: float = 0.1
    reduce_at: int = 8
    vocab_size: int = 1024
    pred_dim: int = 320
    joint_dim: int = 320
    blank_id: int = 0
    ctc_weight: float = 0.3
    lr: float = 2e-3
    warmup: int = 10000
    grad_clip: float = 5.0


def lengths_to_padding_mask(lengths, max_len=None):
    max_len = max_len or int(lengths.max())
    return torch.arange(max_len, device=lengths.device)[None, :] >= lengths[:, None]


def utterance_cmvn(feats, lengths):
    valid = (~lengths_to_padding_mask(lengths, feats.size(1))).unsqueeze(-1)
    feats = feats.masked_fill(~valid, 0.0)
    mean = feats.mean(dim=1, keepdim=True)
    std = feats.std(dim=1, keepdim=True)
    return (feats - mean) / (std + 1e-5)


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
    def __init__(self, d_model, dropout, max_len=5000):
        super().__init__()
        self.xscale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)
        pos = torch.arange(max_len - 1, -max_len, -1.0).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe = torch.zeros(2 * max_len - 1, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)
        self.max_len = max_len

    def forward(self, x):
        t = x.size(1)
        center = self.max_len - 1
        pos_emb = self.pe[:, center - t + 1: center + t]
        return self.dropout(x * self.xscale), self.dropout(pos_emb)


class FeedForwardModule(nn.Module):
    def __init__(self, d, mult, dropout):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d * mult), nn.SiLU(), nn.Dropout(dropout),
                                 nn.Linear(d * mult, d), nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class RelPositionMultiHeadAttention(nn.Module):
    def __init__(self, d, h, dropout):
        super().__init__()
        self.h, self.d_k = h, d // h
        self.linear_q, self.linear_k = nn.Linear(d, d), nn.Linear(d, d)
        self.linear_v, self.linear_out = nn.Linear(d, d), nn.Linear(d, d)
        self.linear_pos = nn.Linear(d, d, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(h, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self.dropout = nn.Dropout(dropout)

    @staticmethod
    def rel_shift(x):
        b, h, t1, t2 = x.size()
        zero_pad = x.new_zeros((b, h, t1, 1))
        x_padded = torch.cat([zero_pad, x], dim=-1).view(b, h, t2 + 1, t1)
        return x_padded[:, :, 1:].view_as(x)[:, :, :, : t2 // 2 + 1]

    def _masked_softmax(self, scores, mask):
        if mask is None:
            return torch.softmax(scores, dim=-1)
        mask = mask.unsqueeze(1)
        scores = scores.masked_fill(mask, -1e9)  # expect: AMP007
        return torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)

    def forward(self, x, pos_emb, mask):
        b, t, _ = x.size()
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_u, k.transpose(-2, -1))
        matrix_bd = self.rel_shift(torch.matmul(q_v, p.transpose(-2, -1)))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        attn = self.dropout(self._masked_softmax(scores, mask))
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, -1)
        return self.linear_out(out)


class SqueezeExcite1d(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(channels, channels // reduction), nn.SiLU(),
                                nn.Linear(channels // reduction, channels))

    def forward(self, x):
        s = x.mean(dim=-1)  # expect: AMP004
        return x * torch.sigmoid(self.fc(s)).unsqueeze(-1)


class ConvolutionModule(nn.Module):
    def __init__(self, d, kernel, dropout, use_se=True):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pointwise_conv1 = nn.Conv1d(d, 2 * d, 1)
        self.depthwise_conv = nn.Conv1d(d, d, kernel, padding=(kernel - 1) // 2, groups=d)
        self.se = SqueezeExcite1d(d) if use_se else nn.Identity()
        self.batch_norm = nn.BatchNorm1d(d)
        self.pointwise_conv2 = nn.Conv1d(d, d, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        x = self.norm(x).transpose(1, 2)
        x = F.glu(self.pointwise_conv1(x), dim=1)
        x = x.masked_fill(pad_mask.unsqueeze(1), 0.0)
        x = self.se(self.depthwise_conv(x))
        x = F.silu(self.batch_norm(x))
        x = self.pointwise_conv2(x)
        return self.dropout(x).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.ff1 = FeedForwardModule(cfg.d_model, cfg.ff_mult, cfg.dropout)
        self.norm_mhsa = nn.LayerNorm(cfg.d_model)
        self.attn = RelPositionMultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.conv = ConvolutionModule(cfg.d_model, cfg.conv_kernel, cfg.dropout)
        self.ff2 = FeedForwardModule(cfg.d_model, cfg.ff_mult, cfg.dropout)
        self.norm_out = nn.LayerNorm(cfg.d_model)

    def forward(self, x, pos_emb, pad_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(self.norm_mhsa(x), pos_emb, pad_mask.unsqueeze(1))
        x = x + self.conv(x, pad_mask)
        x = x + 0.5 * self.ff2(x)
        return self.norm_out(x)


class TimeReduction(nn.Module):
    """Halves the frame rate by averaging projected neighbouring frames."""

    def __init__(self, d, stride=2):
        super().__init__()
        self.stride = stride
        self.proj = nn.Linear(d, d)

    def forward(self, x, lengths):
        b, t, d = x.size()
        pad = (-t) % self.stride
        x = self.proj(x)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        x = x.view(b, -1, self.stride, d).mean(dim=2)  # expect: AMP004
        lengths = torch.div(lengths + self.stride - 1, self.stride, rounding_mode="floor")
        return x, lengths


class ConformerEncoder(nn.Module):
    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.subsample = Conv2dSubsampling(cfg.n_mels, cfg.d_model)
        self.pos_enc = RelPositionalEncoding(cfg.d_model, cfg.dropout)
        self.layers = nn.ModuleList([ConformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.reduce_at = cfg.reduce_at
        self.time_reduction = TimeReduction(cfg.d_model)

    def forward(self, feats, lengths):
        feats = utterance_cmvn(feats, lengths)
        x, lengths = self.subsample(feats, lengths)
        x, pos_emb = self.pos_enc(x)
        pad_mask = lengths_to_padding_mask(lengths, x.size(1))
        for i, layer in enumerate(self.layers):
            if i == self.reduce_at:
                x, lengths = self.time_reduction(x, lengths)
                x, pos_emb = self.pos_enc(x)
                pad_mask = lengths_to_padding_mask(lengths, x.size(1))
            x = layer(x, pos_emb, pad_mask)
        return x, lengths


class Predictor(nn.Module):
    def __init__(self, vocab, dim, blank_id):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=blank_id)
        self.rnn = nn.LSTM(dim, dim, num_layers=1, batch_first=True)
        self.blank_id = blank_id

    def forward(self, targets, state=None):
        y = F.pad(targets, (1, 0), value=self.blank_id)
        out, state = self.rnn(self.embed(y), state)
        return out, state


class JointNetwork(nn.Module):
    def __init__(self, enc_dim, pred_dim, joint_dim, vocab):
        super().__init__()
        self.lin_enc = nn.Linear(enc_dim, joint_dim)
        self.lin_pred = nn.Linear(pred_dim, joint_dim)
        self.out = nn.Linear(joint_dim, vocab)

    def forward(self, enc, pred):
        h = self.lin_enc(enc).unsqueeze(2) + self.lin_pred(pred).unsqueeze(1)
        return self.out(torch.tanh(h))


class ConformerTransducer(nn.Module):
    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.encoder = ConformerEncoder(cfg)
        self.predictor = Predictor(cfg.vocab_size, cfg.pred_dim, cfg.blank_id)
        self.joint = JointNetwork(cfg.d_model, cfg.pred_dim, cfg.joint_dim, cfg.vocab_size)
        self.ctc_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.blank_id = cfg.blank_id
        self.ctc_weight = cfg.ctc_weight

    def forward(self, feats, feat_lens, targets, target_lens):
        enc_out, enc_lens = self.encoder(feats, feat_lens)
        pred_out, _ = self.predictor(targets)
        logits = self.joint(enc_out, pred_out)
        rnnt = torchaudio.functional.rnnt_loss(
            logits.float(), targets.int(), enc_lens.int(), target_lens.int(),
            blank=self.blank_id, reduction="mean")
        ctc_logp = F.log_softmax(self.ctc_head(enc_out), dim=-1).transpose(0, 1)
        ctc = F.ctc_loss(ctc_logp, targets, enc_lens, target_lens, blank=self.blank_id, zero_infinity=True)
        loss = (1 - self.ctc_weight) * rnnt + self.ctc_weight * ctc
        stats = {"rnnt": rnnt.detach(), "ctc": ctc.detach(), "enc_std": enc_out.detach().std()}
        return loss, stats


class TransducerTrainer:
    def __init__(self, model, cfg: ConformerConfig, device="cuda"):
        self.device = device
        self.model = model.to(device)
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._noam)
        self.scaler = torch.amp.GradScaler("cuda")

    def _noam(self, step):
        step = max(step, 1)
        return min(step ** -0.5, step * self.cfg.warmup ** -1.5) * self.cfg.warmup ** 0.5

    def _clip_gradients(self):
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)

    def train_step(self, batch):
        feats, feat_lens, targets, target_lens = (t.to(self.device, non_blocking=True) for t in batch)
        self.model.train()
        with torch.autocast("cuda", dtype=torch.float16):
            loss, stats = self.model(feats, feat_lens, targets, target_lens)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        grad_norm = self._clip_gradients()  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        stats.update(grad_norm=grad_norm, loss_scale=self.scaler.get_scale())
        return stats

    def fit(self, train_loader, epochs, out_dir="exp"):
        os.makedirs(out_dir, exist_ok=True)
        for epoch in range(epochs):
            for i, batch in enumerate(train_loader):
                stats = self.train_step(batch)
                if i % 100 == 0:
                    print(epoch, i, {k: round(float(v), 4) for k, v in stats.items()})
            torch.save(self.model.state_dict(), os.path.join(out_dir, f"epoch{epoch}.pt"))


def collate(batch):
    feats, tokens = zip(*[(item["fbank"], item["tokens"]) for item in batch])
    feat_lens = torch.tensor([f.size(0) for f in feats])
    target_lens = torch.tensor([t.size(0) for t in tokens])
    return (pad_sequence(feats, batch_first=True), feat_lens,
            pad_sequence(tokens, batch_first=True), target_lens)


def build_model(cfg: ConformerConfig, compile_model=False):
    model = ConformerTransducer(cfg)
    return torch.compile(model) if compile_model else model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", default="data/train_shard.pt")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    cfg = ConformerConfig()
    train_loader = DataLoader(torch.load(args.train), batch_size=args.batch_size,
                              shuffle=True, collate_fn=collate, num_workers=4)
    trainer = TransducerTrainer(build_model(cfg, args.compile), cfg)
    trainer.fit(train_loader, args.epochs)


if __name__ == "__main__":
    main()
