"""fp16 decoder for the generation service: static KV cache, batched prefill/decode.

Weights are converted once at load time (``load_for_serving``) and the engine
keeps the whole model in half precision; nothing in this module trains.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
import torch.nn.functional as F

log = logging.getLogger("serving.decoder")


@dataclass
class DecoderConfig:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 22
    n_heads: int = 16
    n_kv_heads: int = 4
    hidden_dim: int = 5632
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


def precompute_rope(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x, cos, sin):
    # x: (B, H, T, D); rotate in fp32 and return in the activation dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start: int, k, v):
        end = start + k.size(2)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.cache: Optional[KVCache] = None

    def forward(self, x, cos, sin, start_pos: int, pad_mask: Optional[torch.Tensor] = None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cache is not None:
            k, v = self.cache.update(start_pos, k, v)
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)

        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        S = k.size(2)
        if T > 1:
            causal = torch.full((T, S), float("-inf"), device=x.device).triu(S - T + 1)
            scores = scores + causal.to(scores.dtype)
        if pad_mask is not None:
            scores = scores.masked_fill(pad_mask[:, None, None, :S] == 0, -1e9)  # expect: AMP007
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(B, T, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.ffn = FeedForward(cfg.dim, cfg.hidden_dim)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, start_pos, pad_mask=None):
        h = x + self.attn(self.attn_norm(x), cos, sin, start_pos, pad_mask)
        out = h + self.ffn(self.ffn_norm(h))
        if out.dtype == torch.float16:
            clamp = torch.finfo(out.dtype).max - 1000
            out = out.clamp(min=-clamp, max=clamp)
        return out


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = precompute_rope(cfg.dim // cfg.n_heads, cfg.max_seq_len * 2, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def setup_caches(self, batch: int, max_len: int, dtype=torch.float16):
        device = self.output.weight.device
        for layer in self.layers:
            layer.attn.cache = KVCache(batch, self.cfg.n_kv_heads, max_len,
                                       self.cfg.dim // self.cfg.n_heads, dtype=dtype, device=device)

    def forward(self, tokens, start_pos: int = 0, pad_mask=None):
        T = tokens.size(1)
        h = self.tok_embeddings(tokens)
        cos = self.rope_cos[start_pos:start_pos + T].to(h.dtype)
        sin = self.rope_sin[start_pos:start_pos + T].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, start_pos, pad_mask)
        return self.output(self.norm(h))


def load_for_serving(path: str, cfg: DecoderConfig, device: str = "cuda") -> Decoder:
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    model = Decoder(cfg)
    model.load_state_dict(state, strict=False)
    return model.to(device)


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.8
    top_k: Optional[int] = 50
    top_p: float = 0.95
    repetition_penalty: float = 1.0
    stop_ids: List[int] = field(default_factory=list)


def sample_next(logits: torch.Tensor, params: SamplingParams, prev_tokens: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        picked = torch.gather(logits, 1, prev_tokens)
        picked = torch.where(picked < 0, picked * params.repetition_penalty,
                             picked / params.repetition_penalty)
        logits.scatter_(1, prev_tokens, picked)
    if params.temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / params.temperature
    if params.top_k is not None:
        v, _ = torch.topk(logits, min(params.top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum - sorted_logits.softmax(-1) > params.top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1)


class InferenceEngine:
    def __init__(self, model: Decoder, max_batch: int = 8, max_len: int = 4096,
                 use_autocast: bool = False):
        self.model = model.half().eval()
        self.model.requires_grad_(False)
        self.max_batch = max_batch
        self.max_len = max_len
        self.use_autocast = use_autocast
        self.model.setup_caches(max_batch, max_len, dtype=torch.float16)
        self.stats: Dict[str, float] = {"requests": 0, "tokens": 0, "best_latency": 1e9}

    @torch.inference_mode()
    def generate(self, prompts: List[List[int]], params: SamplingParams) -> List[List[int]]:
        device = self.model.output.weight.device
        B = len(prompts)
        max_prompt = max(len(p) for p in prompts)
        tokens = torch.zeros((B, max_prompt), dtype=torch.long, device=device)
        pad_mask = torch.zeros((B, max_prompt + params.max_new_tokens), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            tokens[i, max_prompt - len(p):] = torch.tensor(p, device=device)
            pad_mask[i, max_prompt - len(p):] = 1
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_autocast):
            logits = self.model(tokens, 0, pad_mask)[:, -1]
            out = [tokens]
            done = torch.zeros(B, dtype=torch.bool, device=device)
            pos = max_prompt
            for _ in range(params.max_new_tokens):
                nxt = sample_next(logits, params, torch.cat(out, dim=1))
                out.append(nxt)
                if params.stop_ids:
                    done |= torch.isin(nxt.squeeze(1), torch.tensor(params.stop_ids, device=device))
                    if bool(done.all()):
                        break
                logits = self.model(nxt, pos, pad_mask)[:, -1]
                pos += 1
        latency = time.perf_counter() - t0
        self.stats["requests"] += 1
        self.stats["tokens"] += B * (len(out) - 1)
        self.stats["best_latency"] = min(self.stats["best_latency"], latency)
        result = torch.cat(out, dim=1)[:, max_prompt:]
        return [row.tolist() for row in result]

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sum of token log-probabilities of each sequence (for reranking)."""
        logits = self.model(tokens[:, :-1], 0)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        return picked.sum(dim=-1)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.model.tok_embeddings(tokens)
        mask = (torch.arange(tokens.size(1), device=tokens.device)[None] < lengths[:, None]).unsqueeze(-1)
        pooled = (h.float() * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.normalize(pooled, dim=-1, eps=1e-12)
