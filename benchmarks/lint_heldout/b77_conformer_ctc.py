"""Conformer-CTC acoustic model with an auxiliary frame-level VAD head.

Usage:
    python train_conformer.py --train-manifest data/train.jsonl \
        --valid-manifest data/dev.jsonl --vocab data/chars.txt --amp
"""
import argparse
import functools
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from asr.data import AudioDataset, BucketingSampler, collate_batch
from asr.metrics import word_error_rate
from asr.text import CharTokenizer

logger = logging.getLogger("conformer")


def make_pad_mask(lengths, max_len=None):
    """True at padded positions, shape (B, T)."""
    max_len = max_len or int(lengths.max())
    steps = torch.arange(max_len, device=lengths.device)
    return steps.unsqueeze(0) >= lengths.unsqueeze(1)


class GlobalCMVN(nn.Module):
    def __init__(self, stats_file):
        super().__init__()
        stats = np.load(stats_file)
        mean = stats["mean"].astype(np.float32)
        var = stats["var"].astype(np.float32)
        istd = 1.0 / np.sqrt(np.maximum(var, 1e-20))
        self.register_buffer("mean", torch.from_numpy(mean))
        self.register_buffer("istd", torch.from_numpy(istd))

    def forward(self, x):
        return (x - self.mean) * self.istd


class LearnableFrontend(nn.Module):
    """Strided 1-D filterbank on the raw waveform followed by magnitude compression."""

    def __init__(self, n_filters=80, win_length=400, hop_length=160, compression="log", normalize=True):
        super().__init__()
        self.filterbank = nn.Conv1d(1, n_filters, win_length, stride=hop_length,
                                    padding=win_length // 2, bias=False)
        self.compression = compression
        self.normalize = normalize
        nn.init.kaiming_normal_(self.filterbank.weight)

    def forward(self, wav):
        x = self.filterbank(wav.unsqueeze(1))  # (B, n_filters, frames)
        mag = x.abs()
        if self.compression == "log":
            feats = torch.log(mag + 1e-8)  # expect: AMP011
        else:
            feats = mag.pow(1.0 / 3.0)
        if self.normalize:
            # per-utterance, per-channel mean/variance normalisation over time
            feats = (feats - feats.mean(dim=-1, keepdim=True)) / (feats.std(dim=-1, keepdim=True) + 1e-5)
        return feats.transpose(1, 2)


class ConvSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, odim, 3, 2), nn.ReLU(),
            nn.Conv2d(odim, odim, 3, 2), nn.ReLU(),
        )
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, lengths):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        lengths = ((lengths - 1) // 2 - 1) // 2
        return x, lengths


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout, max_len=5000):
        super().__init__()
        self.xscale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x):
        return self.dropout(x * self.xscale + self.pe[:, : x.size(1)])


class FeedForward(nn.Module):
    def __init__(self, d_model, hidden, dropout):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(d_model), nn.Linear(d_model, hidden), nn.SiLU(),
            nn.Dropout(dropout), nn.Linear(hidden, d_model), nn.Dropout(dropout),
        )

    def forward(self, x):
        return self.net(x)


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        self.d_k = d_model // n_heads
        self.h = n_heads
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if pad_mask is not None:
            scores = scores.masked_fill(pad_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, -1)
        return self.dropout(self.out(ctx))


class ConvModule(nn.Module):
    def __init__(self, d_model, kernel_size=31, dropout=0.1, use_se=True, se_ratio=8):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.pointwise1 = nn.Conv1d(d_model, 2 * d_model, 1)
        self.depthwise = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.use_se = use_se
        self.se_reduce = nn.Conv1d(d_model, d_model // se_ratio, 1)
        self.se_expand = nn.Conv1d(d_model // se_ratio, d_model, 1)
        self.bn = nn.BatchNorm1d(d_model)
        self.pointwise2 = nn.Conv1d(d_model, d_model, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pad_mask=None):
        x = self.norm(x).transpose(1, 2)  # (B, C, T)
        x = F.glu(self.pointwise1(x), dim=1)
        if pad_mask is not None:
            x = x.masked_fill(pad_mask.unsqueeze(1), 0.0)
        x = self.depthwise(x)
        if self.use_se:
            if pad_mask is not None:
                valid = (~pad_mask).sum(dim=1, keepdim=True).clamp(min=1).unsqueeze(1)
                s = x.masked_fill(pad_mask.unsqueeze(1), 0.0).sum(dim=-1, keepdim=True) / valid
            else:
                s = x.mean(dim=-1, keepdim=True)  # expect: AMP004
            s = torch.sigmoid(self.se_expand(F.silu(self.se_reduce(s))))
            x = x * s
        x = self.pointwise2(F.silu(self.bn(x)))
        return self.dropout(x.transpose(1, 2))


class ConformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, ff_mult=4, kernel_size=31, dropout=0.1, use_se=True):
        super().__init__()
        self.ff1 = FeedForward(d_model, ff_mult * d_model, dropout)
        self.mhsa = MultiHeadSelfAttention(d_model, n_heads, dropout)
        self.conv = ConvModule(d_model, kernel_size, dropout, use_se=use_se)
        self.ff2 = FeedForward(d_model, ff_mult * d_model, dropout)
        self.final_norm = nn.LayerNorm(d_model)

    def forward(self, x, pad_mask, se_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.mhsa(x, pad_mask)
        x = x + self.conv(x, se_mask)
        x = x + 0.5 * self.ff2(x)
        return self.final_norm(x)


class ConformerCTC(nn.Module):
    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.frontend = LearnableFrontend(cfg.n_mels) if cfg.learnable_frontend else nn.Identity()
        self.cmvn = GlobalCMVN(cfg.cmvn_file) if cfg.cmvn_file else nn.Identity()
        self.subsample = ConvSubsampling(cfg.n_mels, cfg.d_model)
        self.pos_enc = PositionalEncoding(cfg.d_model, cfg.dropout)
        self.blocks = nn.ModuleList(
            [ConformerBlock(cfg.d_model, cfg.n_heads, dropout=cfg.dropout, use_se=cfg.use_se)
             for _ in range(cfg.n_layers)]
        )
        self.masked_se = cfg.masked_se
        self.ctc_head = nn.Linear(cfg.d_model, vocab_size)
        self.vad_head = nn.Linear(cfg.d_model, 1)

    def forward(self, x, lengths):
        x = self.cmvn(self.frontend(x))
        x, lengths = self.subsample(x, lengths)
        x = self.pos_enc(x)
        pad_mask = make_pad_mask(lengths, x.size(1))
        se_mask = pad_mask if self.masked_se else None
        for block in self.blocks:
            x = block(x, pad_mask, se_mask)
        return self.ctc_head(x), lengths, self.vad_head(x).squeeze(-1)


def subsample_targets(vad, lengths, factor=4):
    """Majority-pool frame-level VAD labels to the encoder frame rate."""
    t = lengths.max().item()
    vad = vad[:, : t * factor].float().view(vad.size(0), t, factor)
    return (vad.mean(dim=-1) > 0.5).float()


@torch.inference_mode()
def greedy_decode(log_probs, lengths, tokenizer, blank=0):
    hyps = []
    best = log_probs.argmax(dim=-1).cpu()
    for seq, n in zip(best, lengths.cpu()):
        seq = torch.unique_consecutive(seq[:n])
        hyps.append(tokenizer.decode([int(i) for i in seq if i != blank]))
    return hyps


def train_epoch(model, loader, optimizer, scheduler, scaler, args, epoch):
    model.train()
    amp_autocast = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16, enabled=args.amp)
    optimizer.zero_grad(set_to_none=True)
    start = time.time()
    for it, batch in enumerate(loader):
        feats = batch["feats"].cuda(non_blocking=True)
        feat_lens = batch["feat_lens"].cuda(non_blocking=True)
        targets = batch["targets"].cuda(non_blocking=True)
        target_lens = batch["target_lens"].cuda(non_blocking=True)
        vad = batch["vad"].cuda(non_blocking=True)

        with amp_autocast():
            logits, out_lens, vad_logits = model(feats, feat_lens)
            vad_targets = subsample_targets(vad, out_lens)[:, : vad_logits.size(1)]
            frame_mask = (~make_pad_mask(out_lens, vad_logits.size(1))).float()
            loss_vad = F.binary_cross_entropy(torch.sigmoid(vad_logits), vad_targets, reduction="none")  # expect: AMP003
            loss_vad = (loss_vad * frame_mask).sum() / frame_mask.sum()

        log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)
        loss_ctc = F.ctc_loss(log_probs, targets, out_lens, target_lens, blank=0,
                              reduction="mean", zero_infinity=True)
        loss = loss_ctc + args.vad_weight * loss_vad

        scaler.scale(loss / args.accum_grad).backward()
        if (it + 1) % args.accum_grad == 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)  # expect: AMP006
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if (it + 1) % (args.log_interval * args.accum_grad) == 0:
                logger.info("epoch %d iter %d ctc %.3f vad %.3f grad_norm %.2f lr %.2e (%.1fs)",
                            epoch, it + 1, loss_ctc.item(), loss_vad.item(), grad_norm.item(),
                            scheduler.get_last_lr()[0], time.time() - start)


@torch.no_grad()
def validate(model, loader, tokenizer, args):
    model.eval()
    total_loss, n_utts, hyps, refs = 0.0, 0, [], []
    for batch in loader:
        feats = batch["feats"].cuda(non_blocking=True)
        feat_lens = batch["feat_lens"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            logits, out_lens, _ = model(feats, feat_lens)
        log_probs = logits.float().log_softmax(dim=-1)
        loss = F.ctc_loss(log_probs.transpose(0, 1), batch["targets"].cuda(), out_lens,
                          batch["target_lens"].cuda(), blank=0, reduction="sum", zero_infinity=True)
        total_loss += loss.item()
        n_utts += feats.size(0)
        hyps += greedy_decode(log_probs, out_lens, tokenizer)
        refs += batch["texts"]
    return total_loss / max(n_utts, 1), word_error_rate(hyps, refs)


@torch.inference_mode()
def transcribe(model, feats, feat_lens, tokenizer, half=True):
    model.eval()
    if half:
        model = model.half()
        feats = feats.half()
    logits, out_lens, _ = model(feats, feat_lens)
    return greedy_decode(logits.float().log_softmax(-1), out_lens, tokenizer)


def noam_lambda(d_model, warmup):
    def fn(step):
        step = max(step, 1)
        return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    return fn


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, wer):
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "wer": wer,
    }, path)


def parse_args():
    p = argparse.ArgumentParser(description="Conformer-CTC training")
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--valid-manifest", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--cmvn-file", default=None)
    p.add_argument("--learnable-frontend", action="store_true")
    p.add_argument("--n-mels", type=int, default=80)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--use-se", action="store_true")
    p.add_argument("--masked-se", action="store_true")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-frames", type=int, default=40000)
    p.add_argument("--lr", type=float, default=5.0)
    p.add_argument("--warmup", type=int, default=25000)
    p.add_argument("--accum-grad", type=int, default=4)
    p.add_argument("--grad-clip", type=float, default=5.0)
    p.add_argument("--vad-weight", type=float, default=0.1)
    p.add_argument("--log-interval", type=int, default=100)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--exp-dir", default="exp/conformer_ctc")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(args.exp_dir, exist_ok=True)
    with open(os.path.join(args.exp_dir, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=2)

    tokenizer = CharTokenizer(args.vocab)
    train_set = AudioDataset(args.train_manifest, tokenizer, raw_audio=args.learnable_frontend)
    valid_set = AudioDataset(args.valid_manifest, tokenizer, raw_audio=args.learnable_frontend)
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=BucketingSampler(train_set, args.batch_frames, shuffle=True),
        collate_fn=collate_batch, num_workers=8, pin_memory=True)
    valid_loader = torch.utils.data.DataLoader(
        valid_set, batch_sampler=BucketingSampler(valid_set, args.batch_frames, shuffle=False),
        collate_fn=collate_batch, num_workers=4)

    model = ConformerCTC(args, vocab_size=len(tokenizer)).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model has %.1fM parameters", n_params / 1e6)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(args.d_model, args.warmup))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009

    best_wer = float("inf")
    for epoch in range(1, args.epochs + 1):
        train_epoch(model, train_loader, optimizer, scheduler, scaler, args, epoch)
        val_loss, wer = validate(model, valid_loader, tokenizer, args)
        logger.info("epoch %d valid loss %.3f WER %.2f%%", epoch, val_loss, 100 * wer)
        save_checkpoint(os.path.join(args.exp_dir, f"epoch{epoch}.pt"), model, optimizer,
                        scheduler, scaler, epoch, wer)
        if wer < best_wer:
            best_wer = wer
            save_checkpoint(os.path.join(args.exp_dir, "best.pt"), model, optimizer,
                            scheduler, scaler, epoch, wer)


if __name__ == "__main__":
    main()
