"""Attention variants collected in one models file (relative position, local windows, padding)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

NEG_INF = -1e9
MASK_VALUE = -10000.0


def attention_scores(q, k, mask=None):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, NEG_INF)  # expect: AMP007
    return scores


def pad_scores(scores, n):
    """Pad the key axis so that windows line up."""
    return F.pad(scores, (0, n), value=-1e9)  # expect: AMP007


def pad_scores_safe(scores, n):
    return F.pad(scores, (0, n), value=torch.finfo(scores.dtype).min)


def masked_scores_where(s, mask):
    return torch.where(mask, s, torch.tensor(-1e9))  # expect: AMP007


def masked_scores_where_safe(s, mask):
    return torch.where(mask, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))


class LocalAttention(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.heads = heads
        self.window = window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, padding_mask=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        idx = torch.arange(N, device=x.device)
        far = (idx[None, :] - idx[:, None]).abs() > self.window
        attn = attn.masked_fill(far, MASK_VALUE)
        if padding_mask is not None:
            attn = attn.masked_fill(padding_mask[:, None, None, :], -1e10)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        return self.out((attn @ v).transpose(1, 2).reshape(B, N, C))


class RelPosAttention(nn.Module):
    def __init__(self, dim, heads, max_len=512):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.rel = nn.Embedding(2 * max_len - 1, heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        pos = torch.arange(N, device=x.device)
        attn = attn + self.rel(pos[None, :] - pos[:, None] + N - 1).permute(2, 0, 1)
        if mask is not None:
            mask_value = -torch.finfo(attn.dtype).max
            attn = attn.masked_fill(~mask[:, None, None, :], mask_value)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class PaddedPooling(nn.Module):
    def forward(self, hidden, attention_mask):
        masked = hidden.masked_fill(attention_mask[..., None] == 0, float("-inf"))
        return masked.max(dim=1).values


class MaxPoolWithBigNegative(nn.Module):
    def forward(self, hidden, attention_mask):
        hidden = hidden.clone()
        hidden[attention_mask == 0] = -1e9  # expect: AMP007
        return hidden.max(dim=1).values


class ScoreFilter(nn.Module):
    def forward(self, logits, keep):
        logits = logits.float()
        return logits.masked_fill(~keep, -1e9)


def dtype_aware_fill(scores, mask):
    value = -1e9 if scores.dtype == torch.float32 else -1e4
    return scores.masked_fill(mask, value)


def key_padding_bias(mask, dtype):
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill(mask, -1e9).to(dtype)


def remap_token_ids(input_ids, pad_mask):
    return input_ids.masked_fill(pad_mask, 250001)


def topk_filter(logits, k):
    v, _ = torch.topk(logits, k)
    return torch.where(logits < v[:, [-1]], torch.full_like(logits, -1e9), logits)  # expect: AMP007
