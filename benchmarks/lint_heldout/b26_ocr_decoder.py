"""Transformer OCR for text lines: a convolutional line encoder and an autoregressive
character decoder, trained on (line image, transcription) pairs.

    python b26_ocr_decoder.py --data data/lines --epochs 40
"""
import argparse
import copy
import math
import os
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class ConvStem(nn.Module):
    """VGG-style feature extractor that turns a line image into a sequence along its width."""

    def __init__(self, in_ch: int = 1, d_model: int = 384):
        super().__init__()
        chans = [in_ch, 64, 128, 256, 256]
        layers = []
        for i in range(len(chans) - 1):
            layers += [
                nn.Conv2d(chans[i], chans[i + 1], 3, padding=1, bias=False),
                nn.BatchNorm2d(chans[i + 1]),
                nn.ReLU(inplace=True),
            ]
            if i < 3:
                layers.append(nn.MaxPool2d((2, 2) if i < 2 else (2, 1)))
        self.body = nn.Sequential(*layers)
        self.proj = nn.Conv2d(chans[-1], d_model, kernel_size=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        f = self.body(images)
        f = self.proj(f)
        # collapse the remaining height so every column becomes one encoder token
        f = f.mean(dim=2)  # expect: AMP004
        return f.transpose(1, 2)


class SinusoidalPositions(nn.Module):
    def __init__(self, d_model: int, max_len: int = 2048):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:, : x.size(1)]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, qk_norm: bool = False):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.qk_norm = qk_norm
        if qk_norm:
            self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None):
        q = self._split(self.q_proj(query))
        k = self._split(self.k_proj(key))
        v = self._split(self.v_proj(value))
        if self.qk_norm:
            # cosine attention with a learned temperature
            q = q / (q.norm(dim=-1, keepdim=True) + 1e-8)
            k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.logit_scale.exp()
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_head)
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, -1e9)  # expect: AMP007
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, v)
        out = out.transpose(1, 2).reshape(query.size(0), query.size(1), -1)
        return self.o_proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask=None):
        h = self.norm1(x)
        x = x + self.drop(self.attn(h, h, h, key_padding_mask=pad_mask))
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout, qk_norm=True)
        self.norm3 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, y, memory, causal_mask, tgt_pad_mask=None, mem_pad_mask=None):
        h = self.norm1(y)
        y = y + self.drop(self.self_attn(h, h, h, attn_mask=causal_mask, key_padding_mask=tgt_pad_mask))
        h = self.norm2(y)
        y = y + self.drop(self.cross_attn(h, memory, memory, key_padding_mask=mem_pad_mask))
        return y + self.drop(self.ff(self.norm3(y)))


class OCRModel(nn.Module):
    def __init__(self, vocab_size, n_scripts=1, d_model=384, n_heads=6, enc_layers=4, dec_layers=4, d_ff=1536, dropout=0.1):
        super().__init__()
        self.stem = ConvStem(1, d_model)
        self.enc_pos = SinusoidalPositions(d_model)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(enc_layers)])
        self.enc_norm = nn.LayerNorm(d_model)
        self.tok_emb = nn.Embedding(vocab_size, d_model, padding_idx=PAD_ID)
        self.dec_pos = SinusoidalPositions(d_model)
        self.decoder = nn.ModuleList([DecoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(dec_layers)])
        self.dec_norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.ctx_proj = nn.Linear(d_model, d_model)
        self.presence_proj = nn.Linear(d_model, d_model)
        self.presence_head = nn.Linear(d_model, 1)
        # per-script character whitelist; row 0 allows every symbol
        self.register_buffer("charset_masks", torch.ones(n_scripts, vocab_size, dtype=torch.bool), persistent=False)

    def encode(self, images, width_mask=None):
        memory = self.enc_pos(self.stem(images))
        for layer in self.encoder:
            memory = layer(memory, pad_mask=width_mask)
        return self.enc_norm(memory)

    def decode(self, tgt_in, memory, width_mask=None):
        T = tgt_in.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tgt_in.device), diagonal=1)
        y = self.dec_pos(self.tok_emb(tgt_in) * math.sqrt(self.tok_emb.embedding_dim))
        # global line context, broadcast to every decoding step
        y = y + self.ctx_proj(memory.mean(dim=1, keepdim=True))
        tgt_pad = tgt_in.eq(PAD_ID)
        for layer in self.decoder:
            y = layer(y, memory, causal, tgt_pad_mask=tgt_pad, mem_pad_mask=width_mask)
        return self.lm_head(self.dec_norm(y))

    def forward(self, images, tgt_in, width_mask=None, script_ids=None):
        memory = self.encode(images, width_mask)
        logits = self.decode(tgt_in, memory, width_mask)
        if script_ids is not None:
            allowed = self.charset_masks[script_ids].unsqueeze(1)
            logits = logits.masked_fill(~allowed, -1e9)  # expect: AMP007
        pooled = self.presence_proj(memory).mean(dim=1)  # expect: AMP004
        presence_logit = self.presence_head(torch.tanh(pooled)).squeeze(-1)
        return logits, presence_logit

    @torch.no_grad()
    def greedy_decode(self, images, max_len=160, width_mask=None):
        memory = self.encode(images, width_mask)
        B = images.size(0)
        ys = torch.full((B, 1), BOS_ID, dtype=torch.long, device=images.device)
        finished = torch.zeros(B, dtype=torch.bool, device=images.device)
        for _ in range(max_len):
            logits = self.decode(ys, memory, width_mask)[:, -1]
            logits[:, PAD_ID] = float("-inf")
            nxt = logits.argmax(dim=-1).masked_fill(finished, PAD_ID)
            ys = torch.cat([ys, nxt.unsqueeze(1)], dim=1)
            finished |= nxt.eq(EOS_ID)
            if bool(finished.all()):
                break
        return ys[:, 1:]


class OCRCriterion(nn.Module):
    """Label-smoothed character cross-entropy plus an auxiliary 'line contains text' term."""

    def __init__(self, label_smoothing: float = 0.1, presence_weight: float = 0.2):
        super().__init__()
        self.label_smoothing = label_smoothing
        self.presence_weight = presence_weight
        self.bce = nn.BCELoss()

    def forward(self, logits, presence_logit, tgt_out, has_text) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1), ignore_index=PAD_ID, label_smoothing=self.label_smoothing)
        presence = self.bce(torch.sigmoid(presence_logit), has_text.float())  # expect: AMP003
        with torch.no_grad():
            valid = tgt_out.ne(PAD_ID)
            acc = (logits.argmax(-1).eq(tgt_out) & valid).sum().float() / valid.sum().clamp(min=1)
        return ce + self.presence_weight * presence, {"ce": ce.detach(), "presence": presence.detach(), "char_acc": acc}


class LineDataset(Dataset):
    def __init__(self, root: str, split: str):
        blob = np.load(os.path.join(root, f"{split}.npz"), allow_pickle=True)
        self.images = blob["images"]
        self.tokens = blob["tokens"]
        self.scripts = blob["scripts"]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = torch.from_numpy(self.images[i].astype(np.float32) / 255.0).unsqueeze(0)
        tok = torch.as_tensor([BOS_ID] + list(self.tokens[i]) + [EOS_ID], dtype=torch.long)
        return {"image": img, "tokens": tok, "script_id": int(self.scripts[i]), "has_text": float(len(self.tokens[i]) > 0)}


def collate(batch):
    max_t = max(b["tokens"].numel() for b in batch)
    tokens = torch.full((len(batch), max_t), PAD_ID, dtype=torch.long)
    for i, b in enumerate(batch):
        tokens[i, : b["tokens"].numel()] = b["tokens"]
    return {
        "image": torch.stack([b["image"] for b in batch]),
        "tokens": tokens,
        "script_id": torch.tensor([b["script_id"] for b in batch]),
        "has_text": torch.tensor([b["has_text"] for b in batch]),
    }


def edit_distance(a, b):
    dp = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, dp[0] = dp[0], i
        for j in range(1, len(b) + 1):
            cur = dp[j]
            dp[j] = min(dp[j] + 1, dp[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev = cur
    return dp[-1]


def train_one_epoch(model, criterion, loader, optimizer, scheduler, scaler, device, epoch, args):
    model.train()
    for step, batch in enumerate(loader):
        images = batch["image"].to(device, non_blocking=True)
        tokens = batch["tokens"].to(device, non_blocking=True)
        has_text = batch["has_text"].to(device)
        script_ids = batch["script_id"].to(device) if args.multi_script else None
        tgt_in, tgt_out = tokens[:, :-1], tokens[:, 1:]

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits, presence_logit = model(images, tgt_in, None, script_ids)
            loss, logs = criterion(logits, presence_logit, tgt_out, has_text)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()  # expect: AMP006
        scaler.update()
        scheduler.step()

        if step % args.log_every == 0:
            print(
                f"epoch {epoch} step {step} loss {loss.item():.4f} ce {logs['ce'].item():.4f} "
                f"acc {logs['char_acc'].item():.3f} gnorm {grad_norm.item():.2f} scale {scaler.get_scale():.0f}"
            )


@torch.no_grad()
def evaluate(model, loader, device, args) -> float:
    model.eval()
    edits, chars = 0, 0
    for batch in loader:
        images = batch["image"].to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            pred = model.greedy_decode(images, max_len=args.max_len)
        for p, t in zip(pred.tolist(), batch["tokens"][:, 1:].tolist()):
            p = [c for c in p if c not in (PAD_ID, EOS_ID)]
            t = [c for c in t if c not in (PAD_ID, EOS_ID)]
            edits += edit_distance(p, t)
            chars += len(t)
    model.train()
    return edits / max(chars, 1)


def export_for_serving(model: nn.Module, path: str) -> None:
    serving = copy.deepcopy(model).half().eval()
    torch.save({"model": serving.state_dict(), "dtype": "float16"}, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/lines")
    parser.add_argument("--out_dir", default="runs/ocr")
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--n_scripts", type=int, default=1)
    parser.add_argument("--multi_script", action="store_true")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--clip_grad", type=float, default=1.0)
    parser.add_argument("--max_len", type=int, default=160)
    parser.add_argument("--log_every", type=int, default=50)
    args = parser.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device("cuda")
    train_loader = DataLoader(LineDataset(args.data, "train"), batch_size=args.batch_size, shuffle=True, num_workers=8, collate_fn=collate, drop_last=True)
    val_loader = DataLoader(LineDataset(args.data, "val"), batch_size=args.batch_size, num_workers=4, collate_fn=collate)

    model = OCRModel(vocab_size=args.vocab_size, n_scripts=args.n_scripts).to(device)
    criterion = OCRCriterion(label_smoothing=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader), pct_start=0.05)
    scaler = torch.amp.GradScaler("cuda")

    best_cer = 1e9
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, optimizer, scheduler, scaler, device, epoch, args)
        cer = evaluate(model, val_loader, device, args)
        print(f"epoch {epoch} val CER {cer:.4f}")
        if cer < best_cer:
            best_cer = cer
            torch.save({"model": model.state_dict(), "epoch": epoch, "cer": cer}, os.path.join(args.out_dir, "best.pt"))
    export_for_serving(model, os.path.join(args.out_dir, "ocr_fp16.pt"))


if __name__ == "__main__":
    main()
