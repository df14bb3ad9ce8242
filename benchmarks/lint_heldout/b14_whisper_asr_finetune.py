"""Fine-tune a Whisper-style encoder/decoder on a speech corpus.

Adds an auxiliary CTC head on the encoder (hybrid CTC/attention training) and a
small spoken-language-ID head, following the recipes used for low-resource ASR.
"""
import argparse
import copy
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data import AsrDataset, collate_padded  # local module


@dataclass
class ModelDims:
    n_mels: int = 80
    n_audio_ctx: int = 1500
    n_audio_state: int = 512
    n_audio_head: int = 8
    n_audio_layer: int = 6
    n_vocab: int = 51865
    n_ctc_vocab: int = 256
    n_languages: int = 99
    n_text_ctx: int = 448
    n_text_state: int = 512
    n_text_head: int = 8
    n_text_layer: int = 6


def sinusoids(length, channels, max_timescale=10000):
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state, n_head):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None, key_padding_mask=None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = q @ k
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        if key_padding_mask is not None:
            qk = qk.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        w = F.softmax(qk.float(), dim=-1).to(q.dtype)
        return self.out((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state, n_head, cross_attention=False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        self.mlp = nn.Sequential(nn.Linear(n_state, 4 * n_state), nn.GELU(), nn.Linear(4 * n_state, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None, audio_padding=None):
        x = x + self.attn(self.attn_ln(x), mask=mask)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, key_padding_mask=audio_padding)
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.conv1 = nn.Conv1d(dims.n_mels, dims.n_audio_state, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dims.n_audio_state, dims.n_audio_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(dims.n_audio_ctx, dims.n_audio_state))
        self.blocks = nn.ModuleList(
            [ResidualAttentionBlock(dims.n_audio_state, dims.n_audio_head) for _ in range(dims.n_audio_layer)]
        )
        self.ln_post = LayerNorm(dims.n_audio_state)

    def forward(self, mel):
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        x = x + self.positional_embedding[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


class TextDecoder(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.token_embedding = nn.Embedding(dims.n_vocab, dims.n_text_state)
        self.positional_embedding = nn.Parameter(torch.empty(dims.n_text_ctx, dims.n_text_state))
        self.blocks = nn.ModuleList(
            [ResidualAttentionBlock(dims.n_text_state, dims.n_text_head, True) for _ in range(dims.n_text_layer)]
        )
        self.ln = LayerNorm(dims.n_text_state)
        mask = torch.empty(dims.n_text_ctx, dims.n_text_ctx).fill_(-np.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens, xa, audio_padding=None):
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x, xa, mask=self.mask, audio_padding=audio_padding)
        x = self.ln(x)
        return (x @ self.token_embedding.weight.t()).float()


class LanguageIdHead(nn.Module):
    """Frame-level language scores averaged over the (unpadded) utterance."""

    def __init__(self, n_state, n_languages):
        super().__init__()
        self.proj = nn.Linear(n_state, n_languages)

    def forward(self, x):
        h = self.proj(x)
        return h.mean(dim=1)  # expect: AMP004


class WhisperHybrid(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)
        self.ctc_head = nn.Linear(dims.n_audio_state, dims.n_ctc_vocab)
        self.lid_head = LanguageIdHead(dims.n_audio_state, dims.n_languages)

    def forward(self, mel, tokens, audio_padding=None):
        enc = self.encoder(mel)
        dec_logits = self.decoder(tokens, enc, audio_padding)
        return dec_logits, self.ctc_head(enc), self.lid_head(enc)


def prepare_batch(batch, device):
    mel = batch["mel"]
    # per-utterance CMVN, done on the host in fp32
    mel = (mel - mel.mean(dim=-1, keepdim=True)) / (mel.std(dim=-1, keepdim=True) + 1e-8)
    tokens = batch["tokens"].to(device, non_blocking=True)
    return mel.to(device, dtype=torch.float16, non_blocking=True), tokens, batch["frames"].to(device)  # expect: AMP001


def cosine_lr(step, warmup, total, base_lr):
    if step < warmup:
        return base_lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device, tokenizer):
    model.eval()
    errors, words, total_loss, n = 0, 0, 0.0, 0
    for batch in loader:
        mel = batch["mel"].to(device)
        tokens = batch["tokens"].to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            dec_logits, _, _ = model(mel, tokens[:, :-1])
            loss = F.cross_entropy(dec_logits.transpose(1, 2), tokens[:, 1:], ignore_index=-100)
        total_loss += loss.item()
        n += 1
        hyp = tokenizer.decode_batch(dec_logits.argmax(-1).cpu().tolist())
        ref = tokenizer.decode_batch(batch["tokens"].tolist())
        for h, r in zip(hyp, ref):
            errors += tokenizer.word_edit_distance(h, r)
            words += max(1, len(r.split()))
    model.train()
    return total_loss / max(1, n), errors / max(1, words)


def export_half(model, path):
    serving = copy.deepcopy(model).half().eval()
    torch.save({"dims": model.dims.__dict__, "state_dict": serving.state_dict()}, path)


def train(args):
    device = torch.device("cuda")
    dims = ModelDims(n_ctc_vocab=args.ctc_vocab)
    model = WhisperHybrid(dims).to(device)
    if args.init_from:
        state = torch.load(args.init_from, map_location="cpu")
        missing, unexpected = model.load_state_dict(state["state_dict"], strict=False)
        print(f"loaded {args.init_from}: missing={len(missing)} unexpected={len(unexpected)}")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "ln" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
    )
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)  # expect: AMP009

    train_ds = AsrDataset(args.train_manifest, max_seconds=30.0)
    valid_ds = AsrDataset(args.valid_manifest, max_seconds=30.0)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8, collate_fn=collate_padded)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, num_workers=4, collate_fn=collate_padded)
    tokenizer = train_ds.tokenizer

    total_steps = args.epochs * len(loader) // args.grad_accum
    best_wer = 1e9
    step, t0 = 0, time.time()
    model.train()
    for epoch in range(args.epochs):
        for it, batch in enumerate(loader):
            mel, tokens, frames = prepare_batch(batch, device)
            enc_lengths = (frames + 1) // 2
            audio_padding = torch.arange(mel.shape[-1] // 2, device=device)[None, :] >= enc_lengths[:, None]
            ctc_targets = batch["ctc_targets"].to(device)
            target_lengths = batch["ctc_lengths"].to(device)
            lang = batch["lang"].to(device)

            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.fp16):
                dec_logits, ctc_logits, lid_logits = model(mel, tokens[:, :-1], audio_padding)
                ce = F.cross_entropy(dec_logits.transpose(1, 2), tokens[:, 1:], ignore_index=-100)
                lid = F.cross_entropy(lid_logits, lang)
            log_probs = ctc_logits.log_softmax(-1).transpose(0, 1)
            ctc = F.ctc_loss(log_probs, ctc_targets, enc_lengths, target_lengths, zero_infinity=True)  # expect: AMP002
            blank_rate = ctc_logits.float().softmax(-1)[..., 0].mean()
            loss = (ce + args.ctc_weight * ctc + args.lid_weight * lid) / args.grad_accum
            scaler.scale(loss).backward()

            if (it + 1) % args.grad_accum != 0:
                continue
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, args.warmup, total_steps, args.lr)
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                dt = (time.time() - t0) / args.log_every
                print(f"ep {epoch} step {step} ce {ce.item():.3f} ctc {ctc.item():.3f} "
                      f"lid {lid.item():.3f} blank {blank_rate.item():.2f} gnorm {grad_norm:.2f} "
                      f"scale {scaler.get_scale():.0f} {dt * 1000:.0f}ms/it")
                t0 = time.time()
            if step % args.eval_every == 0:
                val_loss, wer = evaluate(model, valid_loader, device, tokenizer)
                print(f"valid loss {val_loss:.3f} wer {wer * 100:.2f}")
                if wer < best_wer:
                    best_wer = wer
                    torch.save({"dims": dims.__dict__, "state_dict": model.state_dict(), "step": step},
                               os.path.join(args.out_dir, "best.pt"))
    export_half(model, os.path.join(args.out_dir, "model_fp16.pt"))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--valid-manifest", required=True)
    p.add_argument("--init-from", default="")
    p.add_argument("--out-dir", default="runs/whisper_hybrid")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--lid-weight", type=float, default=0.1)
    p.add_argument("--ctc-vocab", type=int, default=256)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=2000)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args)
