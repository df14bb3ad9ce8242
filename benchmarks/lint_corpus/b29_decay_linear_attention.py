"""Long-document classifier with linear-time token mixers.

Mixers: bidirectional exponential-decay retention (parallel form) with a
per-head group norm, or kernelised linear attention (elu + 1 feature map).
Every `hybrid_every`-th block uses softmax attention with QK-norm instead.
Channel mixing follows RWKV (token shift, squared ReLU, receptance gate).
"""
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    max_len: int = 4096
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512
    num_classes: int = 10
    hybrid_every: int = 4
    mixer: str = "decay"
    qk_norm_scale: float = 10.0
    dropout: float = 0.1


@dataclass
class TrainConfig:
    data_dir: str = "data/lra_text"
    batch_size: int = 16
    grad_accum: int = 4
    max_iters: int = 20000
    lr: float = 6e-4
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    eval_interval: int = 500
    compile: bool = True


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


class HeadGroupNorm(nn.Module):
    """Per-head normalisation of the retention output (no affine)."""

    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, y):
        mu = y.mean(dim=-1, keepdim=True)  # expect: AMP004
        sd = y.std(dim=-1, keepdim=True, correction=0)  # expect: AMP004
        return (y - mu) / (sd + self.eps)


def decay_mask(n_head, T, device):
    gammas = 1.0 - torch.exp2(-5.0 - torch.arange(n_head, dtype=torch.float32, device=device))
    idx = torch.arange(T, dtype=torch.float32, device=device)
    dist = (idx[:, None] - idx[None, :]).abs()
    D = torch.exp(dist[None] * torch.log(gammas)[:, None, None])
    return D / D.sum(dim=-1, keepdim=True).sqrt()


class DecayRetention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C = cfg.n_embd
        self.n_head, self.head_dim = cfg.n_head, C // cfg.n_head
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.mix_k = nn.Parameter(torch.full((1, 1, C), 0.5))
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.g_proj = nn.Linear(C, C, bias=False)
        self.out_proj = nn.Linear(C, C, bias=False)
        self.norm = HeadGroupNorm()

    def _split(self, t, B, T):
        return t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

    @staticmethod
    def _parallel_retention(q, k, v, D):
        scores = (q @ k.transpose(-2, -1)) * D
        scores = scores / scores.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1.0)
        return scores @ v

    def forward(self, x, key_mask):
        B, T, C = x.shape
        xk = x * self.mix_k + self.time_shift(x) * (1 - self.mix_k)
        q = self._split(self.q_proj(x), B, T)
        k = self._split(self.k_proj(xk), B, T) * self.head_dim ** -0.5
        v = self._split(self.v_proj(x), B, T)
        D = decay_mask(self.n_head, T, x.device) * key_mask[:, None, None, :]
        y = self.norm(self._parallel_retention(q, k, v, D))
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.out_proj(F.silu(self.g_proj(x)) * y)


class LinearAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    @staticmethod
    def feature_map(x):
        return F.elu(x) + 1.0

    def _linear_attend(self, q, k, v, key_mask):
        k = k.masked_fill(~key_mask[:, None, :, None], 0.0)
        kv = k.transpose(-2, -1) @ v
        k_sum = k.sum(dim=2, keepdim=True)
        z = q @ k_sum.transpose(-2, -1)
        return (q @ kv) / (z + 1e-10)  # expect: AMP011

    def forward(self, x, key_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self._linear_attend(self.feature_map(q), self.feature_map(k), v, key_mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SoftmaxAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.logit_scale = float(cfg.qk_norm_scale)
        self.attn_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, key_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        att = (q @ k.transpose(-2, -1)) * self.logit_scale
        att = torch.where(key_mask[:, None, None, :], att, torch.full_like(att, -1e9))  # expect: AMP007
        att = self.attn_drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class ChannelMix(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C = cfg.n_embd
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.mix_k = nn.Parameter(torch.full((1, 1, C), 0.5))
        self.key = nn.Linear(C, 4 * C, bias=False)
        self.value = nn.Linear(4 * C, C, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)

    def forward(self, x):
        xk = x * self.mix_k + self.time_shift(x) * (1 - self.mix_k)
        k = torch.square(torch.relu(self.key(xk)))
        return torch.sigmoid(self.receptance(xk)) * self.value(k)


MIXERS = {"decay": DecayRetention, "linear": LinearAttention}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, use_softmax: bool):
        super().__init__()
        self.ln1 = RMSNorm(cfg.n_embd)
        self.mixer = SoftmaxAttention(cfg) if use_softmax else MIXERS[cfg.mixer](cfg)
        self.ln2 = RMSNorm(cfg.n_embd)
        self.ffn = ChannelMix(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, key_mask):
        x = x + self.drop(self.mixer(self.ln1(x), key_mask))
        return x + self.drop(self.ffn(self.ln2(x)))


class DecayClassifier(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(
            [Block(cfg, use_softmax=(i + 1) % cfg.hybrid_every == 0) for i in range(cfg.n_layer)])
        self.ln_f = RMSNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.num_classes)

    def forward(self, idx, labels=None, key_mask=None):
        if key_mask is None:
            key_mask = torch.ones_like(idx, dtype=torch.bool)
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, key_mask)
        x = self.ln_f(x)
        m = key_mask.unsqueeze(-1).type_as(x)
        pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        logits = self.head(pooled)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        return logits, loss


def build_model(cfg: ModelConfig):
    return DecayClassifier(cfg)


def get_batch(split, tcfg: TrainConfig, device):
    data = np.load(os.path.join(tcfg.data_dir, f"{split}.npz"), mmap_mode="r")
    ix = np.random.randint(0, data["tokens"].shape[0], size=tcfg.batch_size)
    idx = torch.from_numpy(data["tokens"][ix].astype(np.int64)).to(device, non_blocking=True)
    y = torch.from_numpy(data["labels"][ix].astype(np.int64)).to(device, non_blocking=True)
    return idx, y, idx != 0


@torch.no_grad()
def init_ema(model):
    return [p.detach().bfloat16().clone() for p in model.parameters()]


@torch.no_grad()
def update_ema(ema, model, decay=0.999):
    for e, p in zip(ema, model.parameters()):
        e.lerp_(p.detach().bfloat16(), 1 - decay)
    return torch.stack([e.norm() for e in ema]).norm()


@torch.no_grad()
def estimate_accuracy(model, tcfg, device, iters=50):
    model.eval()
    correct = total = 0
    for _ in range(iters):
        idx, y, mask = get_batch("val", tcfg, device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = model(idx, key_mask=mask)
        correct += (logits.argmax(-1) == y).sum().item()
        total += y.numel()
    model.train()
    return correct / total


def train(mcfg: ModelConfig, tcfg: TrainConfig):
    device = "cuda"
    model = build_model(mcfg).to(device)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "mix_k" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tcfg.lr, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cuda")
    ema = init_ema(model)
    if tcfg.compile:
        model = torch.compile(model)

    model.train()
    t0 = time.time()
    for it in range(tcfg.max_iters):
        lr = tcfg.lr * min(1.0, (it + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * it / tcfg.max_iters))
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(tcfg.grad_accum):
            idx, y, mask = get_batch("train", tcfg, device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, loss = model(idx, y, mask)
                loss = loss / tcfg.grad_accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        optimizer.step()  # expect: AMP006
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        ema_norm = update_ema(ema, model)

        if it % 50 == 0:
            logit_std = logits.detach().std().item()  # expect: AMP004
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it} loss {loss.item() * tcfg.grad_accum:.4f} gnorm {grad_norm:.2f} "
                  f"logit_std {logit_std:.3f} ema_norm {ema_norm.item():.1f} lr {lr:.2e} {dt * 1000 / 50:.1f}ms/it")
        if it > 0 and it % tcfg.eval_interval == 0:
            print(f"iter {it} val acc {estimate_accuracy(model, tcfg, device):.4f}")
    return model


if __name__ == "__main__":
    train(ModelConfig(), TrainConfig())
