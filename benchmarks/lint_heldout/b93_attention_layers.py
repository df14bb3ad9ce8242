"""Attention building blocks shared by the encoder, the decoder and the
vision-language bridge. All modules take additive or boolean masks and
are used both in mixed-precision training and in half-precision serving.
"""
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class FP32LayerNorm(nn.LayerNorm):
    def forward(self, x):
        out = F.layer_norm(x.float(), self.normalized_shape,
                           self.weight.float() if self.weight is not None else None,
                           self.bias.float() if self.bias is not None else None, self.eps)
        return out.type_as(x)


def rope_cache(head_dim: int, max_len: int, theta: float = 500000.0, device=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


def causal_additive_mask(T: int, device, dtype, window: Optional[int] = None):
    mask = torch.full((T, T), float("-inf"), device=device).triu(1)
    if window is not None:
        mask = mask + torch.full((T, T), float("-inf"), device=device).tril(-window)
    return mask.to(dtype)


def padding_to_additive(attention_mask, dtype):
    # (B, S) with 1 = keep -> (B, 1, 1, S) additive bias in the compute dtype
    ext = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - ext) * torch.finfo(dtype).min


def alibi_slopes(n_heads: int):
    def pow2_slopes(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = pow2_slopes(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = pow2_slopes(closest) + pow2_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class SelfAttention(nn.Module):
    def __init__(self, dim, n_heads, dropout=0.0, use_alibi=False):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout
        self.use_alibi = use_alibi
        if use_alibi:
            self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def forward(self, x, attention_mask=None, rope=None, is_causal=True):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if not self.use_alibi and attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=is_causal)
        else:
            pos = torch.arange(T, device=x.device, dtype=torch.float32)
            bias = torch.zeros(self.n_heads, T, T, dtype=torch.float32, device=x.device)
            if is_causal:
                future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                bias = bias.masked_fill(future, -1e9)
            if self.use_alibi:
                bias = bias - self.slopes.float()[:, None, None] * (pos[None, :] - pos[:, None]).abs()
            if attention_mask is not None:
                bias = bias + padding_to_additive(attention_mask, torch.float32)
            bias = bias.clamp(min=torch.finfo(q.dtype).min).to(q.dtype)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class CrossAttention(nn.Module):
    """Text queries attending to image patch tokens (bridge layers)."""

    def __init__(self, dim, ctx_dim, n_heads, dropout=0.0):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.scale = self.head_dim ** -0.5
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(ctx_dim, 2 * dim, bias=False)
        self.out = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.norm = FP32LayerNorm(dim, eps=1e-6)

    def forward(self, x, context, context_mask=None):
        B, T, C = x.shape
        S = context.shape[1]
        q = self.q(self.norm(x)).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(context).view(B, S, 2, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if context_mask is not None:
            attn = attn.masked_fill(~context_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
        y = self.attn_drop(attn) @ v
        return x + self.out(y.transpose(1, 2).reshape(B, T, C))


class RelativePositionBias(nn.Module):
    """T5-style bucketed bias, computed in fp32 and cast at the end."""

    def __init__(self, n_heads, num_buckets=32, max_distance=128, bidirectional=True):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.emb = nn.Embedding(num_buckets, n_heads)

    def _bucket(self, rel):
        nb, ret = self.num_buckets, 0
        if self.bidirectional:
            nb //= 2
            ret = (rel > 0).long() * nb
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        max_exact = nb // 2
        large = max_exact + (torch.log(rel.float() / max_exact + 1e-6)
                             / math.log(self.max_distance / max_exact) * (nb - max_exact)).long()
        large = torch.clamp(large, max=nb - 1)
        return ret + torch.where(rel < max_exact, rel, large)

    def forward(self, q_len, k_len, dtype):
        ctx = torch.arange(q_len, dtype=torch.long, device=self.emb.weight.device)[:, None]
        mem = torch.arange(k_len, dtype=torch.long, device=self.emb.weight.device)[None, :]
        values = self.emb(self._bucket(mem - ctx)).float()
        return values.permute(2, 0, 1).unsqueeze(0).to(dtype)


class EncoderLayer(nn.Module):
    """BERT-style post-norm layer kept for loading the legacy text tower."""

    def __init__(self, dim, n_heads, mlp_ratio=4, dropout=0.1):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim, eps=1e-5)
        self.ln2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, hidden_states, attention_mask):
        B, T, C = hidden_states.shape
        ext = attention_mask[:, None, None, :].to(dtype=hidden_states.dtype)
        ext = (1.0 - ext) * -1e9  # expect: AMP007
        q, k, v = self.qkv(hidden_states).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + ext
        probs = self.drop(F.softmax(scores.float(), dim=-1).type_as(v))
        ctx = (probs @ v).transpose(1, 2).reshape(B, T, C)
        h = self.ln1(hidden_states + self.drop(self.attn_out(ctx)))
        return self.ln2(h + self.drop(self.mlp(h)))


def masked_mean_pool(hidden, mask):
    m = mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.float() * m).sum(dim=1)
    return summed / m.sum(dim=1).clamp(min=1e-9)


def local_attention_scores(q, k, window):
    # q, k: (B, H, T, D); scores outside a +/- window band are blocked
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    T = q.size(-2)
    idx = torch.arange(T, device=q.device)
    outside = (idx[None, :] - idx[:, None]).abs() > window
    neg = -1e9 if scores.dtype == torch.float32 else -1e4
    return scores.masked_fill(outside, neg)


def prefix_lm_mask(prefix_len, T, device, dtype):
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    allowed[:, :prefix_len] = True
    mask = torch.zeros(T, T, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, -65504.0)
