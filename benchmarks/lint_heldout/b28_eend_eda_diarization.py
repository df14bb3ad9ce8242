"""EEND-EDA: end-to-end neural speaker diarization with encoder-decoder attractors.

Frame-level log-mel features -> Transformer encoder -> LSTM encoder/decoder
attractors -> per-speaker activity logits. Trained with a permutation-free BCE
loss plus an attractor-existence loss.
"""
import argparse
import math
import os
from typing import List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def permutations(n: int) -> List[List[int]]:
    if n <= 1:
        return [list(range(n))]
    out = []
    for perm in permutations(n - 1):
        for i in range(n):
            out.append(perm[:i] + [n - 1] + perm[i:])
    return out


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.d_head)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask: Optional[torch.Tensor] = None):
        bsz, t, d = x.shape
        q, k, v = self.qkv(x).view(bsz, t, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, None, :]
            scores = torch.where(keep, scores, torch.tensor(-1e9, device=scores.device))  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(bsz, t, d)
        return self.out(ctx)


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float):
        super().__init__()
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))
        self.norm2 = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask=None):
        x = self.norm1(x + self.drop(self.attn(x, key_padding_mask)))
        return self.norm2(x + self.drop(self.ff(x)))


class EncoderDecoderAttractor(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.encoder = nn.LSTM(d_model, d_model, batch_first=True)
        self.decoder = nn.LSTM(d_model, d_model, batch_first=True)
        self.counter = nn.Linear(d_model, 1)

    def existence_loss(self, att_logits, n_speakers: List[int]):
        labels = torch.zeros_like(att_logits)
        for b, n in enumerate(n_speakers):
            labels[b, :n] = 1.0
        p = torch.sigmoid(att_logits)
        pos = labels * torch.log(p + 1e-8)  # expect: AMP011
        neg = (1.0 - labels) * torch.log(1.0 - p + 1e-8)  # expect: AMP011
        return -(pos + neg).mean()

    def forward(self, emb, n_attractors: int, n_speakers: Optional[List[int]] = None):
        _, (h, c) = self.encoder(emb)
        zeros = emb.new_zeros(emb.size(0), n_attractors, emb.size(-1))
        attractors, _ = self.decoder(zeros, (h, c))
        att_logits = self.counter(attractors).squeeze(-1)
        loss = self.existence_loss(att_logits, n_speakers) if n_speakers is not None else None
        return attractors, att_logits, loss


class EENDEDA(nn.Module):
    def __init__(self, in_dim=345, d_model=256, n_heads=4, d_ff=1024, n_layers=4, dropout=0.1, shuffle=True):
        super().__init__()
        self.input_proj = nn.Linear(in_dim, d_model)
        self.layers = nn.ModuleList([EncoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(n_layers)])
        self.final_norm = nn.LayerNorm(d_model)
        self.eda = EncoderDecoderAttractor(d_model)
        self.shuffle = shuffle

    def encode(self, feats, key_padding_mask=None):
        x = self.input_proj(feats)
        x = x - x.mean(dim=1, keepdim=True)  # expect: AMP004
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return self.final_norm(x)

    def forward(self, feats, key_padding_mask=None, n_speakers: Optional[List[int]] = None, max_speakers=4):
        emb = self.encode(feats, key_padding_mask)
        eda_in = emb
        if self.training and self.shuffle:
            eda_in = emb[:, torch.randperm(emb.size(1), device=emb.device)]
        n_att = (max(n_speakers) if n_speakers is not None else max_speakers) + 1
        attractors, att_logits, exist_loss = self.eda(eda_in, n_att, n_speakers)
        ys = torch.matmul(emb, attractors[:, :-1].transpose(1, 2))
        return ys, att_logits, exist_loss


def pit_loss(ys, labels, n_speakers, frame_mask):
    """Permutation-free BCE: pick the speaker order with the lowest loss per recording."""
    losses, perms = [], []
    for y, t, n, m in zip(ys, labels, n_speakers, frame_mask):
        y, t = y[m, :n], t[m, :n]
        probs = torch.sigmoid(y)
        best, best_perm = None, None
        for perm in permutations(n):
            cand = F.binary_cross_entropy(probs, t[:, perm])  # expect: AMP003
            if best is None or cand.item() < best.item():
                best, best_perm = cand, perm
        losses.append(best)
        perms.append(best_perm)
    return sum(losses) / len(losses), perms


# --------------------------------------------------------------------------- data
class DiarizationChunks(Dataset):
    """Pre-computed chunks: feats (T x 345 spliced log-mel), labels (T x S), n_spk."""

    def __init__(self, root):
        self.files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".npz"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        return torch.from_numpy(z["feats"]).float(), torch.from_numpy(z["labels"]).float(), int(z["n_spk"])


def collate(batch, max_speakers=4):
    t_max = max(b[0].shape[0] for b in batch)
    feats = torch.zeros(len(batch), t_max, batch[0][0].shape[1])
    labels = torch.zeros(len(batch), t_max, max_speakers)
    pad = torch.ones(len(batch), t_max, dtype=torch.bool)
    n_spk = []
    for i, (f, lab, n) in enumerate(batch):
        feats[i, : f.shape[0]] = f
        labels[i, : f.shape[0], : lab.shape[1]] = lab
        pad[i, : f.shape[0]] = False
        n_spk.append(n)
    return feats, labels, pad, n_spk


def diarization_error_rate(probs, labels, perm, threshold=0.5):
    pred = (probs[:, perm] > threshold).astype(np.int32)
    ref = labels.astype(np.int32)
    n_ref = ref.sum(1)
    n_sys = pred.sum(1)
    n_map = np.logical_and(ref == 1, pred == 1).sum(1)
    miss = np.maximum(n_ref - n_sys, 0).sum()
    fa = np.maximum(n_sys - n_ref, 0).sum()
    conf = (np.minimum(n_ref, n_sys) - n_map).sum()
    return (miss + fa + conf) / max(n_ref.sum(), 1)


# --------------------------------------------------------------------------- train / eval
def train(model, loader, optimizer, scheduler, device, epoch, beta=1.0, grad_clip=5.0):
    model.train()
    for step, (feats, labels, pad, n_spk) in enumerate(loader):
        feats = feats.cuda(non_blocking=True).half()  # expect: AMP001
        labels, pad = labels.to(device), pad.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            ys, _, exist_loss = model(feats, pad, n_speakers=n_spk)
            loss_pit, _ = pit_loss(ys, labels, n_spk, ~pad)
            loss = loss_pit + beta * exist_loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        scheduler.step()
        if step % 100 == 0:
            print(f"epoch {epoch} step {step} pit {loss_pit.item():.4f} exist {exist_loss.item():.4f}")


@torch.no_grad()
def evaluate(model, loader, device, threshold=0.5):
    model.eval()
    ders, count_acc = [], []
    for feats, labels, pad, n_spk in loader:
        feats, pad = feats.to(device), pad.to(device)
        ys, att_logits, _ = model(feats, pad)
        att_prob = torch.sigmoid(att_logits.float())
        est_n = (att_prob < threshold).int().argmax(dim=1)
        for b in range(feats.size(0)):
            valid = ~pad[b]
            n = int(n_spk[b])
            y = ys[b, valid, :n].float()
            t = labels[b, valid.cpu(), :n].to(device)
            _, perms = pit_loss(y[None], t[None], [n], valid[None].new_ones(1, y.size(0)))
            ders.append(diarization_error_rate(torch.sigmoid(y).cpu().numpy(), t.cpu().numpy(), perms[0], threshold))
            count_acc.append(float(est_n[b].item() == n))
    return float(np.mean(ders)), float(np.mean(count_acc))


def noam_lambda(d_model, warmup):
    def fn(step):
        step = max(step, 1)
        return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    return fn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-dir", default="data/simu/train_chunks")
    parser.add_argument("--dev-dir", default="data/simu/dev_chunks")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=100000)
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--out", default="exp/eend_eda")
    args = parser.parse_args()

    device = torch.device("cuda")
    train_loader = DataLoader(DiarizationChunks(args.train_dir), batch_size=args.batch_size, shuffle=True,
                              collate_fn=collate, num_workers=8, drop_last=True)
    dev_loader = DataLoader(DiarizationChunks(args.dev_dir), batch_size=8, collate_fn=collate, num_workers=4)
    model = EENDEDA().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(256, args.warmup))
    os.makedirs(args.out, exist_ok=True)
    best_der = 1e9
    for epoch in range(args.epochs):
        train(model, train_loader, optimizer, scheduler, device, epoch, beta=args.beta)
        der, acc = evaluate(model, dev_loader, device)
        print(f"epoch {epoch}: DER {der * 100:.2f}% speaker-count acc {acc:.3f}")
        if der < best_der:
            best_der = der
            torch.save(model.state_dict(), os.path.join(args.out, "best.pth"))


if __name__ == "__main__":
    main()
