"""Minimal LoRA supervised fine-tuning of a small Llama-style decoder, hand-written loop.

Target hardware is a single 16 GB T4 (no bf16), so the base model is kept in fp16 to
fit; only the LoRA adapters on q_proj/v_proj are trained. After training the adapters
are merged and an fp16 checkpoint is written for serving.
"""
import argparse
import copy
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 22
    n_heads: int = 32
    n_kv_heads: int = 4
    hidden_dim: int = 5632
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(in_dtype)


def rotary_cache(head_dim, seq_len, theta, device):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary(x, cos, sin):
    x1, x2 = x[..., ::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def make_causal_mask(seq_len, dtype, device, past_len=0):
    mask = torch.full((seq_len, seq_len), -1e9, dtype=dtype, device=device)  # expect: AMP007
    mask = torch.triu(mask, diagonal=1)
    if past_len > 0:
        mask = torch.cat([torch.zeros(seq_len, past_len, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :]


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=8, alpha=16, dropout=0.05):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, attn_bias):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_bias
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, attn_bias):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_bias)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None):
        B, T = input_ids.shape
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cache(self.cfg.dim // self.cfg.n_heads, T, self.cfg.rope_theta, x.device)
        bias = make_causal_mask(T, x.dtype, x.device)
        if attention_mask is not None:
            pad = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            bias = bias + pad
        for layer in self.layers:
            x = layer(x, cos, sin, bias)
        return self.lm_head(self.norm(x))


def inject_lora(model, targets=("q_proj", "v_proj"), r=8, alpha=16):
    for module in model.modules():
        for name in targets:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r=r, alpha=alpha))
    return model


def finetune(args):
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    cfg = LlamaConfig()
    model = TinyLlama(cfg)
    model.load_state_dict(torch.load(args.base_ckpt, map_location="cpu"), strict=False)
    inject_lora(model, r=args.lora_r, alpha=args.lora_alpha)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    model = model.half().to(device)  # expect: AMP001
    trainable = [p for n, p in model.named_parameters() if p.requires_grad]
    print(f"trainable params: {sum(p.numel() for p in trainable) / 1e6:.2f}M")
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)  # expect: AMP011

    from sft_data import build_loader  # project-local

    loader = build_loader(args.data, args.batch_size, args.max_len)
    total = args.epochs * len(loader) // args.grad_accum
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0)))
    )
    model.train()
    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        for batch in loader:
            input_ids = batch["input_ids"].to(device)
            labels = batch["labels"].to(device)
            attention_mask = batch["attention_mask"].to(device)
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                logits = model(input_ids, attention_mask=attention_mask)
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
                )
                loss = loss / args.grad_accum
            loss.backward()
            step += 1
            if step % args.grad_accum == 0:
                torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if step % (args.grad_accum * args.log_every) == 0:
                print(f"ep {epoch} step {step // args.grad_accum} loss {loss.item() * args.grad_accum:.4f} "
                      f"{time.time() - t0:.0f}s")
    return model


@torch.no_grad()
def generate(model, input_ids, max_new_tokens=128, temperature=0.7, eos_id=2, banned_ids=()):
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(input_ids[:, -model.cfg.max_seq_len:])[:, -1, :] / temperature
        if banned_ids:
            logits[:, list(banned_ids)] = -float("inf")
        probs = torch.softmax(logits.float(), dim=-1)
        nxt = torch.multinomial(probs, num_samples=1)
        input_ids = torch.cat([input_ids, nxt], dim=1)
        if (nxt == eos_id).all():
            break
    return input_ids


def merge_and_export(model, path):
    merged = copy.deepcopy(model).float()
    for module in merged.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                delta = (child.lora_B.weight @ child.lora_A.weight) * child.scaling
                child.base.weight.data += delta
                setattr(module, name, child.base)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(merged.half().state_dict(), path)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--base_ckpt", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="out/tinyllama-lora-fp16.pt")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = finetune(args)
    merge_and_export(model, args.out)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(vars(args), f, indent=2)
