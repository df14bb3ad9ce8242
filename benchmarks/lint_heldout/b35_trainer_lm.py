"""Causal-LM pre-training with a Trainer class (setup / train_step / evaluate).

Precision comes from the run config: ``amp_dtype`` ("auto" picks bf16 where the GPU
supports it, else fp16) drives autocast; the legacy ``--fp16`` flag keeps
half-precision weights and turns the loss scaler on.
"""
import math
import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

PTDTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return PTDTYPE[name]


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


@dataclass
class TrainConfig:
    device: str = "cuda"
    amp_dtype: str = "auto"
    fp16: bool = False
    grad_accum_steps: int = 8
    max_grad_norm: float = 1.0
    lr: float = 6e-4
    weight_decay: float = 0.1
    betas: Tuple[float, float] = (0.9, 0.95)
    compile: bool = True
    eval_interval: int = 500
    eval_iters: int = 100


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(cfg.block_size, cfg.block_size)).view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x, doc_ids: Optional[torch.Tensor] = None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if doc_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            # packed sequences: a token may only attend inside its own document
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.causal[:, :, :T, :T] == 0, float("-inf"))
            same_doc = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
            att = att.masked_fill(~same_doc, -1e9)  # expect: AMP007
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = RMSNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False))

    def forward(self, x, doc_ids=None):
        x = x + self.attn(self.ln_1(x), doc_ids)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None, doc_ids=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, doc_ids)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits[:, [-1], :], None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class Trainer:
    def __init__(self, cfg: TrainConfig, model_cfg: GPTConfig, data):
        self.cfg, self.model_cfg, self.data = cfg, model_cfg, data
        self.step = 0

    def setup(self):
        cfg = self.cfg
        self.ddp = int(os.environ.get("RANK", -1)) != -1
        self.device = torch.device(cfg.device)
        self.amp_dtype = resolve_dtype(cfg.amp_dtype)
        self.use_amp = self.device.type == "cuda" and self.amp_dtype != torch.float32
        self.ctx = torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.use_amp)
        model = GPT(self.model_cfg).to(self.device)
        if cfg.fp16:
            model = model.half()  # expect: AMP001
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)  # expect: AMP011
        try:
            self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.fp16)
        except (AttributeError, TypeError):  # torch < 2.3
            self.scaler = torch.cuda.amp.GradScaler(enabled=cfg.fp16)
        self.raw_model = model
        if cfg.compile:
            model = torch.compile(model)
        if self.ddp:
            model = DDP(model, device_ids=[self.device.index])
        self.model = model

    def _clip_gradients(self):
        if self.cfg.max_grad_norm <= 0:
            return None
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)

    def get_lr(self, it, warmup=2000, max_iters=600000, min_lr=6e-5):
        if it < warmup:
            return self.cfg.lr * (it + 1) / (warmup + 1)
        ratio = min(1.0, (it - warmup) / (max_iters - warmup))
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.cfg.lr - min_lr)

    def train_step(self):
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(self.step)
        self.model.train()
        loss_acc = 0.0
        for micro in range(cfg.grad_accum_steps):
            x, y, doc_ids = self.data.get_batch("train")
            if self.ddp:
                self.model.require_backward_grad_sync = micro == cfg.grad_accum_steps - 1
            with self.ctx:
                _, loss = self.model(x, y, doc_ids)
                loss = loss / cfg.grad_accum_steps
            loss_acc += loss.item()
            self.scaler.scale(loss).backward()
        grad_norm = self._clip_gradients()  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_acc, grad_norm

    @torch.no_grad()
    def evaluate(self):
        out = {}
        self.model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(self.cfg.eval_iters)
            for k in range(self.cfg.eval_iters):
                x, y, doc_ids = self.data.get_batch(split)
                with self.ctx:
                    _, loss = self.model(x, y, doc_ids)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        self.model.train()
        return out

    @torch.no_grad()
    def benchmark(self, iters=20):
        """Forward-only tokens/s with the current precision settings."""
        x, _, _ = self.data.get_batch("val")
        self.model.eval()
        with torch.cuda.amp.autocast(dtype=self.amp_dtype):  # expect: AMP009
            for _ in range(3):
                self.model(x)
            torch.cuda.synchronize()
            t0 = time.time()
            for _ in range(iters):
                self.model(x)
            torch.cuda.synchronize()
        self.model.train()
        return iters * x.numel() / (time.time() - t0)

    def fit(self, max_steps):
        self.setup()
        best_val_loss = 1e9
        while self.step < max_steps:
            loss, grad_norm = self.train_step()
            if self.step % self.cfg.eval_interval == 0:
                losses = self.evaluate()
                if losses["val"] < best_val_loss:
                    best_val_loss = losses["val"]
                    torch.save({"model": self.raw_model.state_dict(), "step": self.step}, "ckpt.pt")
                print(f"step {self.step}: train {losses['train']:.4f} val {losses['val']:.4f} gnorm {grad_norm}")
        return best_val_loss
