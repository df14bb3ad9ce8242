"""Conformer-CTC acoustic model and trainer (ESPnet / NeMo style, trimmed).

    python b51_conformer_ctc.py --train data/train.jsonl --valid data/dev.jsonl --epochs 50
"""
import argparse
import json
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class GlobalCMVN(nn.Module):
    """Utterance-level mean/variance normalisation of the raw filterbank input."""

    def forward(self, feats, mask):
        # feats come straight from the loader: fp32 log-mel frames
        m = mask.unsqueeze(-1).to(feats.dtype)
        n = m.sum(1, keepdim=True).clamp(min=1.0)
        mean = (feats * m).sum(1, keepdim=True) / n
        var = ((feats - mean) ** 2 * m).sum(1, keepdim=True) / n
        return (feats - mean) / torch.sqrt(var + 1e-8) * m


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, odim, 3, 2), nn.ReLU(),
            nn.Conv2d(odim, odim, 3, 2), nn.ReLU(),
        )
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, mask):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, mask[:, :-2:2][:, :-2:2]


class FrameStandardize(nn.Module):
    """Per-utterance standardisation of the subsampled frames."""

    def forward(self, x):
        mu = x.mean(dim=1, keepdim=True)  # expect: AMP004
        sd = x.std(dim=1, keepdim=True)  # expect: AMP004
        return (x - mu) / (sd + 1e-8)  # expect: AMP011


class FeedForwardModule(nn.Module):
    def __init__(self, d_model, expansion=4, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.w1 = nn.Linear(d_model, d_model * expansion)
        self.w2 = nn.Linear(d_model * expansion, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.w2(self.dropout(F.silu(self.w1(self.norm(x))))))


class MultiHeadedSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.norm = nn.LayerNorm(d_model)
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.attn_entropy = None

    def forward(self, x, mask):
        b, t, _ = x.shape
        x = self.norm(x)
        q = self.linear_q(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(~mask[:, None, None, :], -10000.0)
        attn = torch.softmax(scores, dim=-1)
        with torch.no_grad():
            ent = -(attn * torch.log(attn + 1e-8)).sum(-1)
            self.attn_entropy = ent.mean()
        ctx = torch.matmul(self.dropout(attn), v)
        ctx = ctx.transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.dropout(self.linear_out(ctx))


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc1 = nn.Linear(channels, channels // reduction)
        self.fc2 = nn.Linear(channels // reduction, channels)

    def forward(self, x):
        # x: (B, C, T)
        s = x.mean(dim=2, keepdim=True)  # expect: AMP004
        w = torch.sigmoid(self.fc2(F.silu(self.fc1(s.transpose(1, 2)))))
        return x * w.transpose(1, 2)


class ConvolutionModule(nn.Module):
    def __init__(self, d_model, kernel_size=31, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel_size,
                                        padding=kernel_size // 2, groups=d_model)
        self.bn = nn.BatchNorm1d(d_model)
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1)
        self.se = SqueezeExcite(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = self.norm(x).transpose(1, 2)
        x = F.glu(self.pointwise_conv1(x), dim=1)
        x = x.masked_fill(~mask.unsqueeze(1), 0.0)
        x = F.silu(self.bn(self.depthwise_conv(x)))
        x = self.se(self.pointwise_conv2(x))
        return self.dropout(x.transpose(1, 2))


class ConformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, kernel_size, dropout):
        super().__init__()
        self.ff1 = FeedForwardModule(d_model, dropout=dropout)
        self.mhsa = MultiHeadedSelfAttention(d_model, n_heads, dropout)
        self.conv = ConvolutionModule(d_model, kernel_size, dropout)
        self.ff2 = FeedForwardModule(d_model, dropout=dropout)
        self.norm_final = nn.LayerNorm(d_model)

    def forward(self, x, mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.mhsa(x, mask)
        x = x + self.conv(x, mask)
        x = x + 0.5 * self.ff2(x)
        return self.norm_final(x)


class ConformerCTC(nn.Module):
    def __init__(self, idim, vocab, d_model=256, n_heads=4, n_layers=12,
                 kernel_size=31, dropout=0.1):
        super().__init__()
        self.cmvn = GlobalCMVN()
        self.subsample = Conv2dSubsampling(idim, d_model)
        self.frame_norm = FrameStandardize()
        self.layers = nn.ModuleList(
            [ConformerBlock(d_model, n_heads, kernel_size, dropout) for _ in range(n_layers)]
        )
        self.ctc_proj = nn.Linear(d_model, vocab)
        self.register_buffer("log_prior", torch.zeros(vocab))

    def forward(self, feats, feat_lens):
        mask = torch.arange(feats.size(1), device=feats.device)[None] < feat_lens[:, None]
        feats = self.cmvn(feats, mask)
        x, mask = self.subsample(feats, mask)
        x = self.frame_norm(x)
        for layer in self.layers:
            x = layer(x, mask)
        log_probs = F.log_softmax(self.ctc_proj(x), dim=-1)
        return log_probs, mask.sum(-1)


class JsonlSpeechDataset(Dataset):
    def __init__(self, manifest):
        with open(manifest) as f:
            self.items = [json.loads(line) for line in f]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        feats = np.load(item["feats"]).astype(np.float32)
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-8)
        return torch.from_numpy(feats), torch.tensor(item["tokens"], dtype=torch.long)


def collate(batch):
    feats, toks = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    tok_lens = torch.tensor([t.size(0) for t in toks])
    feats = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    return feats, feat_lens, torch.cat(toks), tok_lens


@torch.no_grad()
def evaluate(model, loader, device, prior_scale=0.3):
    model.eval()
    total, frames = 0.0, 0
    for feats, feat_lens, toks, tok_lens in loader:
        feats, feat_lens = feats.to(device), feat_lens.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            log_probs, out_lens = model(feats, feat_lens)
        scores = log_probs - prior_scale * model.log_prior
        total += scores.max(-1).values.sum().item()
        frames += out_lens.sum().item()
    model.train()
    return total / max(frames, 1)


def train(args):
    device = torch.device("cuda")
    model = ConformerCTC(args.idim, args.vocab, n_layers=args.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                  eps=1e-8, weight_decay=1e-3)
    warmup = args.warmup
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, math.sqrt(warmup / (s + 1))))
    scaler = torch.amp.GradScaler("cuda")
    train_loader = DataLoader(JsonlSpeechDataset(args.train), batch_size=args.batch_size,
                              shuffle=True, collate_fn=collate, num_workers=4)
    valid_loader = DataLoader(JsonlSpeechDataset(args.valid), batch_size=args.batch_size,
                              collate_fn=collate)
    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        for step, (feats, feat_lens, toks, tok_lens) in enumerate(train_loader):
            feats, feat_lens = feats.to(device), feat_lens.to(device)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                log_probs, out_lens = model(feats, feat_lens)
                loss = F.ctc_loss(log_probs.transpose(0, 1), toks.to(device), out_lens,
                                  tok_lens.to(device), blank=0, reduction="sum",
                                  zero_infinity=True) / feats.size(0)
            scaler.scale(loss / args.accum_grad).backward()
            if (step + 1) % args.accum_grad != 0:
                continue
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # expect: AMP005
            if not math.isfinite(grad_norm):
                print(f"non-finite grad norm at step {step}, skipping")
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                ent = np.mean([blk.mhsa.attn_entropy.item() for blk in model.layers])
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} attn-ent {ent:.3f}")
        score = -evaluate(model, valid_loader, device)
        if score < best:
            best = score
            torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--idim", type=int, default=80)
    p.add_argument("--vocab", type=int, default=5000)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=25000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accum-grad", type=int, default=4)
    p.add_argument("--grad-clip", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--out", default="conformer_ctc.pt")
    train(p.parse_args())
