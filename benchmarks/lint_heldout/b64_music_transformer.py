"""Music Transformer with relative global attention (Huang et al., ICLR 2019).

Decoder-only model over MIDI-like performance events (note-on/off, time-shift,
velocity), trained on MAESTRO windows. Optional style conditioning: a small
bidirectional encoder with linear attention summarises a reference performance
into one vector that is added to every position. An auxiliary head predicts the
active pitch classes of each bar (multi-label).
"""
import argparse
import logging
import math
import os
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from midi_data import PAD_ID, VOCAB_SIZE, MaestroWindows, decode_events

logger = logging.getLogger("music_transformer")


class MusicOutput(NamedTuple):
    logits: torch.Tensor
    pc_logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8) * self.weight


class ScaleNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(dim ** 0.5))
        self.eps = eps

    def forward(self, x):
        return x * (self.g / torch.norm(x, dim=-1, keepdim=True).clamp(min=self.eps))


def make_norm(kind, dim):
    return {"rms": RMSNorm, "scale": ScaleNorm, "layer": nn.LayerNorm}[kind](dim)


class RelativeGlobalAttention(nn.Module):
    """Multi-head attention with learned relative position embeddings and the
    memory-efficient "skewing" trick."""

    def __init__(self, d_model, n_heads, max_seq, dropout=0.1):
        super().__init__()
        self.h = n_heads
        self.dh = d_model // n_heads
        self.max_seq = max_seq
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.Er = nn.Parameter(torch.randn(max_seq, self.dh) * 0.02)
        self.dropout = nn.Dropout(dropout)

    @staticmethod
    def _skew(qe):
        b, h, length, _ = qe.shape
        padded = F.pad(qe, (1, 0))
        return padded.reshape(b, h, length + 1, length)[:, :, 1:, :]

    def forward(self, x, mask=None):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        er = self.Er[self.max_seq - length:]
        srel = self._skew(torch.matmul(q, er.transpose(0, 1)))
        scores = (torch.matmul(q, k.transpose(-2, -1)) + srel) / math.sqrt(self.dh)
        if mask is not None:
            scores = scores.masked_fill(mask, -1e9)  # expect: AMP007
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, length, -1)
        return self.out(out)


class LinearAttention(nn.Module):
    """Non-causal linear attention, elu(x) + 1 feature map (Katharopoulos et al., 2020)."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h = n_heads
        self.dh = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        q = F.elu(q) + 1
        k = F.elu(k) + 1
        kv = torch.matmul(k.transpose(-2, -1), v)
        k_sum = k.sum(dim=2, keepdim=True)
        z = 1.0 / (torch.matmul(q, k_sum.transpose(-2, -1)) + 1e-8)  # expect: AMP011
        out = torch.matmul(q, kv) * z
        return self.out(out.transpose(1, 2).reshape(b, length, -1))


class FeedForward(nn.Sequential):
    def __init__(self, d_model, d_ff, dropout):
        super().__init__(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))


class StyleEncoder(nn.Module):
    def __init__(self, d_model, n_layers=2, n_heads=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, d_model, padding_idx=PAD_ID)
        self.attn = nn.ModuleList(LinearAttention(d_model, n_heads) for _ in range(n_layers))
        self.ff = nn.ModuleList(FeedForward(d_model, 2 * d_model, 0.1) for _ in range(n_layers))
        self.style_proj = nn.Linear(d_model, d_model)

    def forward(self, ref_tokens):
        h = self.embed(ref_tokens)
        for attn, ff in zip(self.attn, self.ff):
            h = h + attn(h)
            h = h + ff(h)
        return self.style_proj(h).mean(dim=1)  # expect: AMP004


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, max_seq, dropout, norm):
        super().__init__()
        self.norm1 = make_norm(norm, d_model)
        self.attn = RelativeGlobalAttention(d_model, n_heads, max_seq, dropout)
        self.norm2 = make_norm(norm, d_model)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = x + self.dropout(self.attn(self.norm1(x), mask))
        return x + self.dropout(self.ff(self.norm2(x)))


class MusicTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.d_model = args.d_model
        self.bar_len = args.bar_len
        self.embed = nn.Embedding(VOCAB_SIZE, args.d_model, padding_idx=PAD_ID)
        self.style_encoder = StyleEncoder(args.d_model) if args.style else None
        self.layers = nn.ModuleList(
            DecoderLayer(args.d_model, args.n_heads, 4 * args.d_model, args.max_seq, args.dropout, args.norm)
            for _ in range(args.n_layers)
        )
        self.final_norm = make_norm(args.norm, args.d_model)
        self.lm_head = nn.Linear(args.d_model, VOCAB_SIZE)
        self.bar_proj = nn.Linear(args.d_model, args.d_model)
        self.pc_head = nn.Linear(args.d_model, 12)

    def features(self, tokens, ref_tokens=None):
        length = tokens.size(1)
        h = self.embed(tokens) * math.sqrt(self.d_model)
        if self.style_encoder is not None and ref_tokens is not None:
            h = h + self.style_encoder(ref_tokens).unsqueeze(1)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=tokens.device), diagonal=1)
        for layer in self.layers:
            h = layer(h, causal)
        return self.final_norm(h)

    def forward(self, tokens, ref_tokens=None):
        b, length = tokens.shape
        h = self.features(tokens, ref_tokens)
        bar = self.bar_proj(h)
        bar = bar.view(b, length // self.bar_len, self.bar_len, -1).mean(dim=2)  # expect: AMP004
        return MusicOutput(logits=self.lm_head(h), pc_logits=self.pc_head(bar))

    @torch.no_grad()
    def next_token_logits(self, tokens, ref_tokens=None):
        return self.lm_head(self.features(tokens, ref_tokens)[:, -1])


class PitchClassLoss(nn.Module):
    """Multi-label loss on the 12 pitch classes sounding in each bar."""

    def forward(self, pc_logits, pc_target):
        p = torch.sigmoid(pc_logits)
        nll = -(pc_target * torch.log(p + 1e-8) + (1 - pc_target) * torch.log(1 - p + 1e-8))  # expect: AMP011
        return nll.mean()


def train(model, loader, optimizer, scheduler, scaler, args, start_step=0):
    model.train()
    pc_criterion = PitchClassLoss()
    step = start_step
    for batch in loader:
        x = batch["input"].cuda(non_blocking=True)
        y = batch["target"].cuda(non_blocking=True)
        chroma = batch["bar_chroma"].cuda(non_blocking=True)
        ref = batch["reference"].cuda(non_blocking=True) if args.style else None

        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            out = model(x, ref_tokens=ref)
            lm_loss = F.cross_entropy(out.logits.reshape(-1, VOCAB_SIZE), y.reshape(-1),
                                      ignore_index=PAD_ID, label_smoothing=args.label_smoothing)
            pc_loss = pc_criterion(out.pc_logits, chroma)
            loss = lm_loss + args.pc_weight * pc_loss

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1

        if step % args.log_every == 0:
            logger.info("step %d  lm %.4f  pc %.4f  ppl %.2f  lr %.2e", step, lm_loss.item(), pc_loss.item(),
                        math.exp(min(lm_loss.item(), 20)), scheduler.get_last_lr()[0])
        if step % args.save_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "step": step}, os.path.join(args.out, "last.pt"))
        if step >= args.max_steps:
            break
    return step


@torch.no_grad()
def generate(model, primer, n_steps, max_seq, temperature=1.0, top_k=None, banned: Optional[torch.Tensor] = None):
    model.eval()
    seq = primer
    for _ in range(n_steps):
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model.next_token_logits(seq[:, -max_seq:])
        logits = logits.float() / temperature
        if banned is not None:
            logits = logits.masked_fill(banned, float("-inf"))
        if top_k:
            kth = torch.topk(logits, top_k).values[:, [-1]]
            logits[logits < kth] = -float("inf")
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/music_transformer")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--bar-len", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--norm", default="rms", choices=["rms", "scale", "layer"])
    p.add_argument("--style", action="store_true")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--pc-weight", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--sample", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.out, exist_ok=True)

    model = MusicTransformer(args).cuda()
    if args.sample:
        state = torch.load(os.path.join(args.out, "last.pt"), map_location="cuda")
        model.load_state_dict(state["model"])
        primer = torch.tensor([[PAD_ID + 1]], device="cuda")
        events = generate(model, primer, n_steps=2048, max_seq=args.max_seq, temperature=0.95, top_k=64)
        decode_events(events[0].tolist()).write(os.path.join(args.out, "sample.mid"))
        return

    dataset = MaestroWindows(args.data, seq_len=args.max_seq, bar_len=args.bar_len, with_reference=args.style)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=6, drop_last=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5)
    )
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)  # expect: AMP009

    step = 0
    while step < args.max_steps:
        step = train(model, loader, optimizer, scheduler, scaler, args, start_step=step)
    logger.info("done after %d steps", step)


if __name__ == "__main__":
    main()
