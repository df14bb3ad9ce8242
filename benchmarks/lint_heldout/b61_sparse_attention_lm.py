"""Longformer/BigBird-style masked LM: sliding-window + global tokens + block-summary routing.

Pre-training script (MLM). fp16 autocast through a module-level ``ctx`` (nanoGPT style).
"""
import math
import os
import time
from collections import namedtuple
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

MLMOutput = namedtuple("MLMOutput", ["logits", "loss", "aux"])


@dataclass
class SparseLMConfig:
    vocab_size: int = 32000
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 8
    window: int = 128
    block_size: int = 64
    n_global: int = 16
    n_memory: int = 32
    max_len: int = 4096
    dropout: float = 0.1
    attention: str = "longformer"


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def band_mask(T, window, device):
    idx = torch.arange(T, device=device)
    return (idx[None, :] - idx[:, None]).abs() <= window // 2


class SparseAttentionBase(nn.Module):
    """Shared projections; subclasses build the sparse score pattern in ``_attend``."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.window = cfg.window
        self.block_size = cfg.block_size
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def _split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, key_padding, global_mask):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = self._split(q), self._split(k), self._split(v)
        scores = self._attend(q, k, key_padding, global_mask)
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
        ctx = torch.matmul(self.drop(probs), v)
        return self.out(ctx.transpose(1, 2).reshape(B, T, D))


class LongformerAttention(SparseAttentionBase):
    def _attend(self, q, k, key_padding, global_mask):
        T = q.size(-2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        is_global = global_mask[:, None, :, None] | global_mask[:, None, None, :]
        allowed = band_mask(T, self.window, q.device)[None, None] | is_global
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return scores.masked_fill(~key_padding[:, None, None, :], -1e9)  # expect: AMP007


class BlockSummaryAttention(SparseAttentionBase):
    """BigBird-like: every query is routed to blocks through one summary key per block."""

    def _attend(self, q, k, key_padding, global_mask):
        B, H, T, Dh = k.shape
        nb = T // self.block_size
        k_blocks = k[:, :, : nb * self.block_size].reshape(B, H, nb, self.block_size, Dh)
        k_summary = k_blocks.mean(dim=3)  # expect: AMP004
        route = torch.matmul(q, k_summary.transpose(-1, -2)) / math.sqrt(Dh)
        route = F.pad(route.repeat_interleave(self.block_size, dim=-1), (0, T - nb * self.block_size))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(Dh) + route
        allowed = band_mask(T, self.window, q.device)[None, None] | global_mask[:, None, None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        pad_bias = (1.0 - key_padding[:, None, None, :].to(scores.dtype)) * -10000.0
        return scores + pad_bias


ATTENTION = {"longformer": LongformerAttention, "bigbird": BlockSummaryAttention}


class GlobalTokenSelector(nn.Module):
    """Learns which tokens become global (Gumbel top-k over a sigmoid gate)."""

    def __init__(self, d_model, n_global):
        super().__init__()
        self.n_global = n_global
        self.score = nn.Sequential(nn.Linear(d_model, d_model // 4), nn.GELU(), nn.Linear(d_model // 4, 1))

    def forward(self, h, key_padding):
        gate = torch.sigmoid(self.score(h).squeeze(-1))
        log_gate = torch.log(gate + 1e-10)  # expect: AMP011
        if self.training:
            u = torch.rand_like(log_gate)
            log_gate = log_gate - torch.log(-torch.log(u + 1e-6) + 1e-6)
        log_gate = log_gate.masked_fill(~key_padding, float("-inf"))
        idx = log_gate.topk(self.n_global, dim=-1).indices
        global_mask = torch.zeros_like(key_padding).scatter_(1, idx, True)
        global_mask[:, 0] = True  # [CLS] is always global
        return global_mask, gate


class MemoryCompressor(nn.Module):
    """Compresses the sequence into n_memory segment summaries and broadcasts them back."""

    def __init__(self, d_model, n_memory):
        super().__init__()
        self.n_memory = n_memory
        self.proj = nn.Linear(d_model, d_model)
        self.read = nn.Linear(d_model, d_model)

    def forward(self, h):
        B, T, D = h.shape
        seg = T // self.n_memory
        m = self.proj(h)
        mem = m[:, : seg * self.n_memory].view(B, self.n_memory, seg, D).mean(dim=2)  # expect: AMP004
        back = self.read(mem).repeat_interleave(seg, dim=1)
        return F.pad(back, (0, 0, 0, T - seg * self.n_memory))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model)
        self.attn = ATTENTION[cfg.attention](cfg)
        self.ln2 = RMSNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout)
        )

    def forward(self, x, key_padding, global_mask):
        x = x + self.attn(self.ln1(x), key_padding, global_mask)
        return x + self.mlp(self.ln2(x))


class SparseMLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.extras = nn.ModuleDict({
            "selector": GlobalTokenSelector(cfg.d_model, cfg.n_global),
            "memory": MemoryCompressor(cfg.d_model, cfg.n_memory),
        })
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, input_ids, attention_mask, labels=None):
        key_padding = attention_mask.bool()
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.tok(input_ids) + self.pos(pos)[None]
        global_mask, gate = self.extras["selector"](h, key_padding)
        h = h + self.extras["memory"](h)
        for block in self.blocks:
            h = block(h, key_padding, global_mask)
        hn = self.ln_f(h)
        logits = self.lm_head(hn)
        seq_repr = hn.mean(dim=1)
        aux = {"gate_density": gate.float().mean(), "seq_norm": seq_repr.norm(dim=-1).mean()}
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return MLMOutput(logits, loss, aux)


def mask_tokens(input_ids, attention_mask, mask_id, vocab_size, p=0.15):
    labels = input_ids.clone()
    prob = torch.full(input_ids.shape, p, device=input_ids.device)
    masked = torch.bernoulli(prob).bool() & attention_mask.bool()
    labels[~masked] = -100
    inputs = input_ids.clone()
    inputs[masked] = mask_id
    rand = torch.bernoulli(torch.full(input_ids.shape, 0.1, device=input_ids.device)).bool() & masked
    inputs[rand] = torch.randint(vocab_size, input_ids.shape, device=input_ids.device)[rand]
    return inputs, labels


# -- training script ---------------------------------------------------------------
cfg = SparseLMConfig(attention=os.environ.get("ATTN", "longformer"))
device = "cuda"  # "cpu", "cuda:1", ... (overridden from the command line on clusters)
device_type = "cuda" if "cuda" in device else "cpu"
batch_size, seq_len, grad_accum, max_iters, eval_interval = 8, 4096, 4, 100_000, 1000
learning_rate, grad_clip, mask_id = 3e-4, 1.0, 4
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.float16)

model = SparseMLM(cfg).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
scaler = torch.cuda.amp.GradScaler()  # expect: AMP009


def get_batch(split):
    ids = torch.randint(5, cfg.vocab_size, (batch_size, seq_len), device=device)
    am = torch.ones_like(ids)
    pad = int(torch.randint(0, seq_len // 4, (1,)))
    am[:, seq_len - pad :] = 0
    inputs, labels = mask_tokens(ids, am, mask_id, cfg.vocab_size)
    return inputs, am, labels


@torch.no_grad()
def estimate_loss(eval_iters=20):
    model.eval()
    losses = torch.zeros(eval_iters)
    for i in range(eval_iters):
        inputs, am, labels = get_batch("val")
        with ctx:
            out = model(inputs, am, labels)
        losses[i] = out.loss.item()
    model.train()
    return losses.mean().item()


best_val_loss = 1e9
t0 = time.time()
for it in range(max_iters):
    if it % eval_interval == 0:
        val = estimate_loss()
        print(f"iter {it}: val loss {val:.4f}")
        if val < best_val_loss:
            best_val_loss = val
            torch.save({"model": model.state_dict(), "cfg": cfg}, "sparse_mlm.pt")
    for micro in range(grad_accum):
        inputs, am, labels = get_batch("train")
        with ctx:
            out = model(inputs, am, labels)
            loss = (out.loss + 0.01 * out.aux["gate_density"]) / grad_accum
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if it % 100 == 0:
        print(f"iter {it}: loss {loss.item() * grad_accum:.4f}, {time.time() - t0:.1f}s")
