"""Conformer-CTC acoustic model, trained in half precision end to end.

Utterances run up to 30 s (3000 frames before subsampling), so attention and the CMVN
statistics span long sequences.
"""
import argparse
import math
import os
from itertools import islice

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader, Dataset


class ManifestDataset(Dataset):
    def __init__(self, manifest, vocab):
        with open(manifest) as f:
            self.items = [line.rstrip("\n").split("\t") for line in f]
        self.vocab = {c: i + 1 for i, c in enumerate(vocab)}  # 0 is the CTC blank

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        wav, sr = torchaudio.load(path)
        feats = torchaudio.compliance.kaldi.fbank(wav, num_mel_bins=80, sample_frequency=sr)
        return feats, torch.tensor([self.vocab[c] for c in text if c in self.vocab])


def collate(batch):
    feats, targets = zip(*batch)
    feat_lens = torch.tensor([f.shape[0] for f in feats])
    target_lens = torch.tensor([t.shape[0] for t in targets])
    return nn.utils.rnn.pad_sequence(feats, batch_first=True), feat_lens, torch.cat(targets), target_lens


@torch.inference_mode()
def estimate_cmvn(dataset, device, num_utts=2000):
    feats = torch.cat([f for f, _ in islice(iter(dataset), num_utts)], dim=0)
    x = feats.to(device).half()
    mean = x.mean(dim=0)
    istd = torch.rsqrt(x.var(dim=0, unbiased=False) + 1e-10)  # expect: AMP011
    return mean, istd


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores.masked_fill_(~mask[:, None, None, :], -1e10)  # expect: AMP007
        attn = self.dropout(torch.softmax(scores, dim=-1))
        return self.out(torch.matmul(attn, v).transpose(1, 2).reshape(B, T, -1))


class ConvModule(nn.Module):
    def __init__(self, d_model, kernel_size=31):
        super().__init__()
        self.pw1 = nn.Conv1d(d_model, 2 * d_model, 1)
        self.dw = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.bn = nn.BatchNorm1d(d_model)
        self.pw2 = nn.Conv1d(d_model, d_model, 1)

    def forward(self, x):
        x = F.glu(self.pw1(x.transpose(1, 2)), dim=1)
        return self.pw2(F.silu(self.bn(self.dw(x)))).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, ff_mult=4, dropout=0.1):
        super().__init__()
        ff = lambda: nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, ff_mult * d_model), nn.SiLU(),
                                   nn.Dropout(dropout), nn.Linear(ff_mult * d_model, d_model))
        self.ff1, self.ff2 = ff(), ff()
        self.norm_att = nn.LayerNorm(d_model)
        self.att = MultiHeadSelfAttention(d_model, n_heads, dropout)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConvModule(d_model)
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x, mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.att(self.norm_att(x), mask)
        x = x + self.conv(self.norm_conv(x))
        x = x + 0.5 * self.ff2(x)
        return self.norm_out(x)


class ConformerCTC(nn.Module):
    def __init__(self, vocab_size, d_model=256, n_heads=4, n_layers=16):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, d_model, 3, 2), nn.ReLU(), nn.Conv2d(d_model, d_model, 3, 2), nn.ReLU())
        self.proj = nn.Linear(d_model * 19, d_model)
        self.blocks = nn.ModuleList([ConformerBlock(d_model, n_heads) for _ in range(n_layers)])
        self.head = nn.Linear(d_model, vocab_size + 1)

    def forward(self, feats, lens):
        x = self.subsample(feats.unsqueeze(1))
        B, C, T, Fq = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(B, T, C * Fq))
        out_lens = ((lens - 1) // 2 - 1) // 2
        mask = torch.arange(T, device=x.device)[None, :] < out_lens[:, None]
        for blk in self.blocks:
            x = blk(x, mask)
        return F.log_softmax(self.head(x).float(), dim=-1), out_lens


def noam(step, d_model, warmup):
    step = max(step, 1)
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-manifest", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--peak-scale", type=float, default=5.0)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--exp-dir", default="exp/conformer_ctc")
    args = ap.parse_args()

    device = torch.device("cuda")
    vocab = open(args.vocab).read().split("\n")
    train_ds = ManifestDataset(args.train_manifest, vocab)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8, collate_fn=collate)
    cmvn_mean, cmvn_istd = estimate_cmvn(train_ds, device)

    model = ConformerCTC(len(vocab)).to(device).half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: args.peak_scale * noam(s, 256, args.warmup))
    param_dtype = next(model.parameters()).dtype
    os.makedirs(args.exp_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for feats, feat_lens, targets, target_lens in loader:
            feats = ((feats.to(device) - cmvn_mean) * cmvn_istd).to(param_dtype)
            feat_lens, targets, target_lens = feat_lens.to(device), targets.to(device), target_lens.to(device)
            log_probs, out_lens = model(feats, feat_lens)
            loss = F.ctc_loss(log_probs.transpose(0, 1), targets, out_lens, target_lens,
                              blank=0, reduction="mean", zero_infinity=True)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                print(f"epoch {epoch} step {step} ctc {loss.item():.3f} gnorm {grad_norm.item():.2f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}")
        torch.save({"model": model.state_dict(), "cmvn": (cmvn_mean, cmvn_istd)},
                   os.path.join(args.exp_dir, f"epoch-{epoch}.pt"))


if __name__ == "__main__":
    main()
