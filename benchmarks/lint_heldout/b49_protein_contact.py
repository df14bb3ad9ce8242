"""Residue-residue contact prediction from a single sequence plus PSSM features.

1D residual encoder -> pairwise outer concatenation -> dilated 2D residual
tower with row-wise axial attention -> symmetric contact logits.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

AA = "ACDEFGHIKLMNPQRSTVWYX"


class SeqEncoder(nn.Module):
    def __init__(self, d_in=41, d_model=64, n_layers=3):
        super().__init__()
        self.inp = nn.Conv1d(d_in, d_model, 1)
        self.layers = nn.ModuleList([nn.Conv1d(d_model, d_model, 5, padding=2) for _ in range(n_layers)])

    def forward(self, x):
        h = self.inp(x)
        for conv in self.layers:
            h = h + F.relu(conv(h))
        return h


class DilatedResBlock2d(nn.Module):
    def __init__(self, channels, dilation):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=dilation, dilation=dilation)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=dilation, dilation=dilation)

    def forward(self, x):
        h = self.conv1(x)
        mu = h.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        var = h.var(dim=(2, 3), keepdim=True, unbiased=False)  # expect: AMP004
        h = (h - mu) * torch.rsqrt(var + 1e-10)  # expect: AMP011
        h = self.conv2(F.relu(h))
        return F.relu(x + h)


class RowAxialAttention(nn.Module):
    def __init__(self, channels, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(channels, 3 * channels, bias=False)
        self.out = nn.Linear(channels, channels)

    def forward(self, x, pair_mask):
        b, c, length, _ = x.shape
        rows = x.permute(0, 2, 3, 1)
        q, k, v = self.qkv(rows).chunk(3, dim=-1)
        q = q.reshape(b, length, length, self.heads, -1).transpose(2, 3)
        k = k.reshape(b, length, length, self.heads, -1).transpose(2, 3)
        v = v.reshape(b, length, length, self.heads, -1).transpose(2, 3)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~pair_mask[:, :, None, None, :], -1e9)  # expect: AMP007
        attn = scores.softmax(dim=-1)
        ctx = (attn @ v).transpose(2, 3).reshape(b, length, length, c)
        return x + self.out(ctx).permute(0, 3, 1, 2)


class ContactNet(nn.Module):
    def __init__(self, d_in=41, d_seq=64, d_pair=64):
        super().__init__()
        self.seq = SeqEncoder(d_in, d_seq)
        self.pair_in = nn.Conv2d(2 * d_seq + 1, d_pair, 1)
        self.tower = nn.Sequential(
            DilatedResBlock2d(d_pair, 1),
            DilatedResBlock2d(d_pair, 2),
            DilatedResBlock2d(d_pair, 4),
            DilatedResBlock2d(d_pair, 8),
        )
        self.axial = RowAxialAttention(d_pair)
        self.head = nn.Conv2d(d_pair, 1, 1)

    def forward(self, feats, mask):
        h = self.seq(feats)
        length = h.size(-1)
        left = h[:, :, :, None].expand(-1, -1, -1, length)
        right = h[:, :, None, :].expand(-1, -1, length, -1)
        idx = torch.arange(length, device=h.device)
        sep = (idx[None, :] - idx[:, None]).abs().float().log1p()
        sep = sep.to(h.dtype)[None, None].expand(h.size(0), 1, length, length)
        pair = self.pair_in(torch.cat([left, right, sep], dim=1))
        pair = self.tower(pair)
        pair_mask = mask[:, :, None] & mask[:, None, :]
        pair = self.axial(pair, pair_mask)
        logits = self.head(pair).squeeze(1)
        logits = 0.5 * (logits + logits.transpose(-1, -2))
        return logits.masked_fill(~pair_mask, -1e4)


def one_hot_pssm(seq, pssm):
    idx = np.array([AA.index(a) if a in AA else len(AA) - 1 for a in seq])
    onehot = np.eye(len(AA), dtype=np.float32)[idx]
    return np.concatenate([onehot, pssm.astype(np.float32)], axis=1).T


@torch.no_grad()
def top_l_precision(model, loader, device, min_sep=24):
    model.eval()
    precisions = []
    for feats, mask, contacts in loader:
        probs = torch.sigmoid(model(feats.to(device), mask.to(device)).float()).cpu().numpy()
        for p, m, c in zip(probs, mask.numpy(), contacts.numpy()):
            length = int(m.sum())
            p, c = p[:length, :length], c[:length, :length]
            i, j = np.triu_indices(length, k=min_sep)
            scores = p.copy()
            scores[np.abs(np.subtract.outer(np.arange(length), np.arange(length))) < min_sep] = -1e9
            order = np.argsort(-scores[i, j])[:length]
            precisions.append(float(c[i[order], j[order]].mean()))
    model.train()
    return float(np.mean(precisions)) if precisions else 0.0


def train(cfg, train_loader, val_loader):
    device = torch.device("cuda")
    model = ContactNet(d_pair=cfg["d_pair"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda")
    criterion = nn.BCELoss(reduction="none")
    accum = cfg.get("accum_steps", 4)
    for epoch in range(cfg["epochs"]):
        for it, (feats, mask, contacts) in enumerate(train_loader):
            feats, mask, contacts = feats.to(device), mask.to(device), contacts.to(device).float()
            pair_mask = (mask[:, :, None] & mask[:, None, :]).float()
            with torch.autocast("cuda", dtype=torch.float16):
                probs = torch.sigmoid(model(feats, mask))
                per_pair = criterion(probs, contacts)  # expect: AMP003
                loss = (per_pair * pair_mask).sum() / pair_mask.sum().clamp(min=1.0)
            scaler.scale(loss / accum).backward()
            if (it + 1) % accum == 0:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
                scaler.step(optimizer)  # expect: AMP006
                optimizer.zero_grad(set_to_none=True)
        prec = top_l_precision(model, val_loader, device)
        print(f"epoch {epoch}: top-L precision {prec:.3f}")
    return model
