"""Transformer building blocks shared by the text and the speech models (trained with fp16 autocast)."""
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

NEG_INF = -1e9
MASK_VALUE = -10000.0


def causal_mask(n: int, device) -> torch.Tensor:
    return torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)


class MultiHeadAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.1):
        super().__init__()
        assert dim % heads == 0
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None, causal: bool = False):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if causal:
            scores = scores.masked_fill(causal_mask(n, x.device), NEG_INF)  # expect: AMP007
        if pad_mask is not None:
            scores = scores.masked_fill(pad_mask[:, None, None, :], float("-inf"))
        attn = self.drop(scores.softmax(dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, -1))


class RelativePositionAttention(nn.Module):
    """Attention with a learned relative bias (ported from an old TF codebase)."""

    def __init__(self, dim: int, heads: int, max_rel: int = 128):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.rel_bias = nn.Embedding(2 * max_rel + 1, heads)
        self.max_rel = max_rel
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        pos = torch.arange(n, device=x.device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.max_rel, self.max_rel) + self.max_rel
        sim = sim + self.rel_bias(rel).permute(2, 0, 1)
        if mask is not None:
            sim[~mask[:, None, None, :].expand_as(sim)] = -1e10  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class LocalAttention(nn.Module):
    def __init__(self, dim, heads, window=64):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        idx = torch.arange(n, device=x.device)
        far = (idx[None, :] - idx[:, None]).abs() > self.window
        big_neg = -torch.finfo(scores.dtype).max
        scores = scores.masked_fill(far, big_neg)
        return torch.matmul(scores.softmax(-1), v)


class PaddedPooling(nn.Module):
    """Max pooling over time that ignores padding."""

    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(h.size(1), device=h.device)[None, :] >= lengths[:, None]
        h = h.masked_fill(mask.unsqueeze(-1), -65504.0)
        return h.max(dim=1).values


class AlibiAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)])
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, x, key_padding_mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        bias = self.slopes[:, None, None] * torch.arange(n, device=x.device)[None, None, :]
        scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5 + bias
        if key_padding_mask is not None:
            fill = -1e9 if scores.dtype == torch.float32 else -1e4
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], fill)
        scores = torch.where(causal_mask(n, x.device), torch.tensor(-1e9, device=x.device), scores)  # expect: AMP007
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


class ConvSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, x_lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        x_lens = ((x_lens - 1) // 2 - 1) // 2
        # padded frames get a large negative energy so that the later max-pool ignores them
        x = F.pad(x, (0, 0, 0, 2), value=MASK_VALUE)
        return x, x_lens


def length_regulator_mask(durations: torch.Tensor, max_len: int = 100000) -> torch.Tensor:
    cum = torch.cumsum(durations, dim=1)
    return torch.arange(max_len, device=durations.device)[None, :] < cum[:, -1:]
