"""nanoGPT with QK-norm attention and top-2 mixture-of-experts MLPs in every other block."""
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    n_expert: int = 8
    top_k: int = 2
    moe_every: int = 2
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class QKNorm(nn.Module):
    """Per-head RMS normalisation of queries and keys (keeps attention logits bounded)."""

    def __init__(self, head_dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(head_dim))

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.eps) * self.scale  # expect: AMP004


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.q_norm = QKNorm(self.head_dim)
        self.k_norm = QKNorm(self.head_dim)
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class RouterAuxLossMixin:
    def load_balancing_loss(self, router_probs, expert_index):
        num_experts = router_probs.size(-1)
        tokens_per_expert = F.one_hot(expert_index, num_experts).float().mean(dim=(0, 1))
        router_prob_per_expert = router_probs.mean(dim=0)
        return num_experts * (tokens_per_expert * router_prob_per_expert).sum()

    def router_z_loss(self, router_logits):
        return torch.logsumexp(router_logits, dim=-1).pow(2).mean()


class MoELayer(RouterAuxLossMixin, nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = nn.ModuleList([MLP(config) for _ in range(config.n_expert)])
        self.z_loss_coef = config.z_loss_coef
        self.aux_loss = torch.zeros(())
        self.router_logit_std = torch.zeros(())

    def forward(self, x):
        B, T, C = x.shape
        x_flat = x.view(-1, C)
        router_logits = self.router(x_flat)
        router_probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        topk_probs, topk_idx = router_probs.topk(self.top_k, dim=-1)
        topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x_flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(topk_idx == e)
            if token_idx.numel() == 0:
                continue
            gate = topk_probs[token_idx, slot].unsqueeze(-1).to(x_flat.dtype)
            out.index_add_(0, token_idx, expert(x_flat[token_idx]) * gate)
        self.aux_loss = self.load_balancing_loss(router_probs, topk_idx) + self.z_loss_coef * self.router_z_loss(router_logits)
        with torch.no_grad():
            self.router_logit_std = router_logits.std(dim=-1).mean()  # expect: AMP004
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = RMSNorm(config.n_embd)
        self.mlp = MoELayer(config) if layer_idx % config.moe_every == 1 else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.ln_f = RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        aux = sum(blk.mlp.aux_loss for blk in self.blocks if isinstance(blk.mlp, MoELayer))
        return logits, loss + self.config.aux_loss_coef * aux

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    @classmethod
    def from_checkpoint(cls, path, **overrides):
        ckpt = torch.load(path, map_location="cpu")
        model = cls(GPTConfig(**{**ckpt["model_args"], **overrides}))
        model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
        return model

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


data_dir = os.path.join("data", "openwebtext")
device = "cuda"
dtype = "bfloat16"
device_type = "cuda" if "cuda" in device else "cpu"
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)


def get_batch(split, batch_size, block_size):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model, eval_iters, batch_size, block_size):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, batch_size, block_size)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def train(max_iters=5000, batch_size=12, block_size=1024, grad_accum=40, lr=6e-4, grad_clip=1.0, eval_interval=250):
    model = GPT(GPTConfig(block_size=block_size))
    model.to(device)
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # expect: AMP009
    optimizer = model.configure_optimizers(0.1, lr, (0.9, 0.95), device_type)
    model = torch.compile(model)
    best_val_loss = 1e9
    X, Y = get_batch("train", batch_size, block_size)
    t0 = time.time()
    for it in range(max_iters):
        if it % eval_interval == 0:
            losses = estimate_loss(model, 200, batch_size, block_size)
            best_val_loss = min(best_val_loss, float(losses["val"]))
        for micro_step in range(grad_accum):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / grad_accum
            X, Y = get_batch("train", batch_size, block_size)
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if it % 10 == 0:
            print(f"iter {it}: loss {loss.item() * grad_accum:.4f}, {(time.time() - t0) * 1000:.0f}ms")
            t0 = time.time()
    return model, best_val_loss


def finetune(ckpt_path, max_iters=2000, batch_size=8, block_size=1024, lr=3e-5):
    """Full-parameter finetune with weights stored in bf16 to halve optimizer memory."""
    model = GPT.from_checkpoint(ckpt_path, dropout=0.1)
    model.to(device)
    model.to(torch.bfloat16)  # expect: AMP001
    model.train()
    optimizer = model.configure_optimizers(0.0, lr, (0.9, 0.95), device_type)
    for it in range(max_iters):
        X, Y = get_batch("train", batch_size, block_size)
        with ctx:
            _, loss = model(X, Y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model
