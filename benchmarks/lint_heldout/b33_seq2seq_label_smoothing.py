"""Pre-LN Transformer for translation: label smoothing, Noam schedule, beam search.

Adapted from the Annotated Transformer, with QK-LayerNorm on the attention
heads and optional fp16 autocast (or a pure-fp16 mode for small GPUs).
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from wmt import build_wmt_loaders, PAD, BOS, EOS  # local


class LayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        # statistics in fp32 whatever the input dtype
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)
        std = x32.std(-1, keepdim=True)
        return (self.a_2 * (x32 - mean) / (std + self.eps) + self.b_2).to(x.dtype)


class QKLayerNorm(nn.Module):
    """Per-head normalisation of queries and keys (keeps attention logits bounded)."""

    def __init__(self, d_k):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d_k))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)  # expect: AMP004
        std = x.std(-1, keepdim=True)  # expect: AMP004
        return self.gain * (x - mean) / (std + 1e-8)  # expect: AMP011


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k, self.h = d_model // h, h
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.q_norm = QKLayerNorm(self.d_k)
        self.k_norm = QKLayerNorm(self.d_k)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        B = query.size(0)
        q = self.q_norm(self.w_q(query).view(B, -1, self.h, self.d_k).transpose(1, 2))
        k = self.k_norm(self.w_k(key).view(B, -1, self.h, self.d_k).transpose(1, 2))
        v = self.w_v(value).view(B, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)  # expect: AMP007
        p_attn = self.dropout(scores.softmax(dim=-1))
        x = torch.matmul(p_attn, v).transpose(1, 2).contiguous().view(B, -1, self.h * self.d_k)
        return self.w_o(x)


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(F.relu(self.w_1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, h, d_ff, dropout):
        super().__init__()
        self.self_attn = MultiHeadedAttention(h, d_model, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = LayerNorm(d_model), LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.drop(self.self_attn(h, h, h, mask))
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, h, d_ff, dropout):
        super().__init__()
        self.self_attn = MultiHeadedAttention(h, d_model, dropout)
        self.src_attn = MultiHeadedAttention(h, d_model, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.norms = nn.ModuleList([LayerNorm(d_model) for _ in range(3)])
        self.drop = nn.Dropout(dropout)

    def forward(self, x, memory, src_mask, tgt_mask):
        h = self.norms[0](x)
        x = x + self.drop(self.self_attn(h, h, h, tgt_mask))
        h = self.norms[1](x)
        x = x + self.drop(self.src_attn(h, memory, memory, src_mask))
        return x + self.drop(self.ff(self.norms[2](x)))


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class Transformer(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.src_embed, self.tgt_embed = nn.Embedding(src_vocab, d_model), nn.Embedding(tgt_vocab, d_model)
        self.pos = PositionalEncoding(d_model)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, h, d_ff, dropout) for _ in range(N)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model, h, d_ff, dropout) for _ in range(N)])
        self.enc_norm, self.dec_norm = LayerNorm(d_model), LayerNorm(d_model)
        self.generator = nn.Linear(d_model, tgt_vocab)

    def encode(self, src, src_mask):
        x = self.pos(self.src_embed(src) * math.sqrt(self.d_model))
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        x = self.pos(self.tgt_embed(tgt) * math.sqrt(self.d_model))
        for layer in self.decoder:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.dec_norm(x)

    def forward(self, src, tgt, src_mask, tgt_mask):
        out = self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)
        return F.log_softmax(self.generator(out), dim=-1)


def subsequent_mask(size, device):
    return torch.triu(torch.ones(1, size, size, device=device), diagonal=1) == 0


def build_model(args, src_vocab, tgt_vocab):
    return Transformer(src_vocab, tgt_vocab, N=args.layers, d_model=args.d_model, d_ff=4 * args.d_model, h=args.heads)


class LabelSmoothingLoss(nn.Module):
    def __init__(self, size, padding_idx, smoothing=0.1):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.padding_idx, self.size = padding_idx, size
        self.confidence, self.smoothing = 1.0 - smoothing, smoothing

    def forward(self, log_probs, target):
        with torch.no_grad():
            true_dist = torch.full_like(log_probs, self.smoothing / (self.size - 2))
            true_dist.scatter_(1, target.unsqueeze(1), self.confidence)
            true_dist[:, self.padding_idx] = 0
            true_dist.masked_fill_((target == self.padding_idx).unsqueeze(1), 0.0)
        return self.criterion(log_probs, true_dist)


def run_epoch(model, loader, criterion, optimizer, scheduler, scaler, args, device):
    model.train()
    for i, (src, tgt) in enumerate(loader):
        src, tgt = src.to(device), tgt.to(device)
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        src_mask = (src != PAD).unsqueeze(-2).unsqueeze(1)
        tgt_mask = ((tgt_in != PAD).unsqueeze(-2) & subsequent_mask(tgt_in.size(1), device)).unsqueeze(1)
        ntokens = (tgt_out != PAD).sum()
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=args.amp):
            log_probs = model(src, tgt_in, src_mask, tgt_mask)
            loss = criterion(log_probs.reshape(-1, log_probs.size(-1)), tgt_out.reshape(-1)) / ntokens
            loss = loss / args.accum_steps
        loss = scaler.scale(loss)
        loss.backward()
        if (i + 1) % args.accum_steps == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            optimizer.step()  # expect: AMP006
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if i % 100 == 0:
            print(f"step {i} loss/tok {loss.item() * args.accum_steps / scaler.get_scale():.4f} lr {scheduler.get_last_lr()[0]:.2e}")


@torch.inference_mode()
def beam_search(model, src, src_mask, max_len=128, beam_size=4, alpha=0.6):
    memory = model.encode(src, src_mask)
    memory, src_mask = memory.repeat(beam_size, 1, 1), src_mask.repeat(beam_size, 1, 1, 1)
    ys = torch.full((beam_size, 1), BOS, dtype=torch.long, device=src.device)
    scores = torch.zeros(beam_size, device=src.device)
    scores[1:] = float("-inf")
    finished = torch.zeros(beam_size, dtype=torch.bool, device=src.device)
    for step in range(max_len):
        out = model.decode(memory, src_mask, ys, subsequent_mask(ys.size(1), src.device).unsqueeze(1))
        log_probs = F.log_softmax(model.generator(out[:, -1]).float(), dim=-1)
        log_probs[finished] = float("-inf")
        log_probs[finished, EOS] = 0.0
        cand = (scores[:, None] + log_probs).view(-1)
        scores, flat = cand.topk(beam_size)
        beam, tok = flat // log_probs.size(-1), flat % log_probs.size(-1)
        ys = torch.cat([ys[beam], tok[:, None]], dim=1)
        finished = finished[beam] | (tok == EOS)
        if finished.all():
            break
    length_penalty = ((5.0 + (ys != EOS).sum(-1)) / 6.0) ** alpha
    return ys[(scores / length_penalty).argmax()]


@torch.no_grad()
def validate(model, loader, criterion, device):
    model.eval()
    total, tokens = 0.0, 0
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        src_mask = (src != PAD).unsqueeze(-2).unsqueeze(1)
        tgt_mask = ((tgt_in != PAD).unsqueeze(-2) & subsequent_mask(tgt_in.size(1), device)).unsqueeze(1)
        log_probs = model(src, tgt_in, src_mask, tgt_mask)
        total += criterion(log_probs.reshape(-1, log_probs.size(-1)), tgt_out.reshape(-1)).item()
        tokens += (tgt_out != PAD).sum().item()
    model.train()
    return total / tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", dest="d_model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--accum-steps", dest="accum_steps", type=int, default=8)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--pure-fp16", dest="pure_fp16", action="store_true", help="fp16 weights, for 8GB cards")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    train_loader, val_loader, src_vocab, tgt_vocab = build_wmt_loaders(batch_tokens=4096)
    model = build_model(args, src_vocab, tgt_vocab).to(device)
    if args.pure_fp16:
        model = model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)  # expect: AMP011
    noam = lambda s: args.d_model ** -0.5 * min(max(s, 1) ** -0.5, max(s, 1) * args.warmup ** -1.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009
    criterion = LabelSmoothingLoss(tgt_vocab, PAD, smoothing=0.1)

    best_val = 1e9
    for epoch in range(args.epochs):
        run_epoch(model, train_loader, criterion, optimizer, scheduler, scaler, args, device)
        val_loss = validate(model, val_loader, criterion, device)
        if val_loss < best_val:
            best_val = val_loss
            torch.save(copy.deepcopy(model).half().state_dict(), "transformer_best_fp16.pt")
        src, _ = next(iter(val_loader))
        hyp = beam_search(model.eval(), src[:1].to(device), (src[:1] != PAD).unsqueeze(-2).unsqueeze(1).to(device))
        model.train()
        print(f"epoch {epoch} val loss/tok {val_loss:.4f} sample {hyp.tolist()[:20]}")


if __name__ == "__main__":
    main()
