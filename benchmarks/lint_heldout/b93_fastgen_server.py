"""Batched decoding for the chat model with a static KV cache.

Inference-only re-implementation of the decoder (same parameter names as the
training code, so checkpoints load directly). Weights are kept in half
precision on the GPU; the cache is preallocated for ``max_batch`` sequences.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    ffn_hidden: int = 5632
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    max_seq_len: int = 4096


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).type_as(x)


def precompute_freqs(head_dim: int, max_seq_len: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rope(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs[None, None]).flatten(-2)
    return out.type_as(x)


class KVCache(nn.Module):
    def __init__(self, n_layers, max_batch, n_heads, max_seq_len, head_dim, dtype, device):
        super().__init__()
        shape = (n_layers, max_batch, n_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, layer, k_new, v_new, start):
        B, _, T, _ = k_new.shape
        self.k[layer, :B, :, start:start + T] = k_new.to(self.k.dtype)
        self.v[layer, :B, :, start:start + T] = v_new.to(self.v.dtype)
        return self.k[layer, :B, :, :start + T], self.v[layer, :B, :, :start + T]

    def reset(self):
        self.k.zero_()
        self.v.zero_()


def cached_attention(q, k, v, key_padding, start_pos):
    # q: (B, H, Tq, D); k, v: (B, H, Tk, D), already in the cache dtype
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    Tq, Tk = q.size(-2), k.size(-2)
    if Tq > 1:
        causal = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=start_pos)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    scores.masked_fill_(key_padding[:, None, None, :Tk], -1e9)  # expect: AMP007
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.w13 = nn.Linear(args.dim, 2 * args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x, freqs, cache, start_pos, key_padding):
        B, T, C = x.shape
        h = self.attention_norm(x)
        q, k, v = self.wqkv(h).split(C, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        k, v = cache.update(self.layer, k, v, start_pos)
        y = cached_attention(q, k, v, key_padding, start_pos)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        freqs = precompute_freqs(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cis", freqs, persistent=False)

    def forward(self, tokens, cache, start_pos, key_padding):
        h = self.tok_embeddings(tokens)
        freqs = self.freqs_cis[start_pos:start_pos + tokens.size(1)]
        for layer in self.layers:
            h = layer(h, freqs, cache, start_pos, key_padding)
        return self.output(self.norm(h))


def load_for_serving(path: str, dtype: torch.dtype, device: torch.device) -> Transformer:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = Transformer(ModelArgs(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"], strict=False)
    if dtype == torch.float16:
        model = model.half()
    elif dtype == torch.bfloat16:
        model = model.to(torch.bfloat16)
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model


def sample_next(logits, temperature, top_p, banned=None):
    logits = logits[:, -1, :].float()
    if banned is not None:
        logits = logits.masked_fill(banned, -1e9)
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    sorted_probs[(cum - sorted_probs) > top_p] = 0.0
    sorted_probs.div_(sorted_probs.sum(dim=-1, keepdim=True))
    choice = torch.multinomial(sorted_probs, num_samples=1)
    return torch.gather(sorted_idx, -1, choice)


@torch.inference_mode()
def generate(model, cache, prompts, max_new_tokens, temperature, top_p, pad_id=0):
    device = cache.k.device
    B = len(prompts)
    T = max(len(p) for p in prompts)
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    key_padding = torch.zeros(B, model.args.max_seq_len, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, T - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
        key_padding[i, : T - len(p)] = True  # left padding
    logits = model(tokens, cache, 0, key_padding)
    out, pos = [], T
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p)
        out.append(nxt)
        logits = model(nxt, cache, pos, key_padding)
        pos += 1
    return torch.cat(out, dim=1).tolist()


def warmup(model, cache, steps=3):
    tokens = torch.randint(0, model.vocab_size, (1, 32), device=cache.k.device)
    no_pad = torch.zeros(1, model.args.max_seq_len, dtype=torch.bool, device=cache.k.device)
    with torch.inference_mode(), torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
        for _ in range(steps):
            model(tokens, cache, 0, no_pad)
    cache.reset()
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description="static-cache batched generation")
    parser.add_argument("checkpoint")
    parser.add_argument("--prompts", required=True, help="jsonl file with a 'tokens' list per line")
    parser.add_argument("--dtype", default="float16", choices=list(DTYPES))
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    args = parser.parse_args()

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    model = load_for_serving(args.checkpoint, dtype, device)
    a = model.args
    cache = KVCache(a.n_layers, args.max_batch, a.n_heads, a.max_seq_len, a.dim // a.n_heads, dtype, device)
    warmup(model, cache)

    with open(args.prompts) as f:
        prompts = [json.loads(line)["tokens"] for line in f if line.strip()]

    n_tokens, t0 = 0, time.perf_counter_ns()
    for i in range(0, len(prompts), args.max_batch):
        batch = prompts[i:i + args.max_batch]
        completions = generate(model, cache, batch, args.max_new_tokens, args.temperature, args.top_p)
        n_tokens += sum(len(c) for c in completions)
        cache.reset()
    elapsed_s = (time.perf_counter_ns() - t0) / 1e9
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    print(f"{n_tokens} tokens in {elapsed_s:.1f}s: {n_tokens / elapsed_s:.1f} tok/s, peak {peak_gib:.2f} GiB")


if __name__ == "__main__":
    main()
