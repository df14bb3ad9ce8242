"""Small selective-SSM (Mamba-style) character LM that trains on a laptop CPU.

The CUDA selective-scan kernel is replaced by a log-space parallel scan
(h_t = a_t * h_{t-1} + b_t computed with cumsum / logcumsumexp), so the whole
model runs under CPU bf16 autocast without custom kernels.
"""
import argparse
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
class SSMConfig:
    vocab_size: int = 256
    d_model: int = 256
    n_layer: int = 6
    d_conv: int = 4
    expand: int = 2
    norm_eps: float = 1e-5


@dataclass
class LMOutput:
    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None


class RMSNorm(nn.Module):
    """Pre-norm on the residual stream (fp32: embedding + branch outputs)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(ms + self.eps) * self.weight


class GatedRMSNorm(nn.Module):
    """Mamba-2 style norm(y * silu(z)) applied inside the mixer."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y, z):
        y = y * F.silu(z)
        var = y.pow(2).mean(-1, keepdim=True)  # expect: AMP004
        return y * torch.rsqrt(var + self.eps) * self.weight


class MambaMixer(nn.Module):
    def __init__(self, cfg: SSMConfig):
        super().__init__()
        d_inner = cfg.expand * cfg.d_model
        self.in_proj = nn.Linear(cfg.d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, cfg.d_conv, groups=d_inner, padding=cfg.d_conv - 1)
        self.gate_proj = nn.Linear(d_inner, d_inner)
        self.value_proj = nn.Linear(d_inner, d_inner)
        self.norm = GatedRMSNorm(d_inner, eps=cfg.norm_eps)
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=False)

    def scan(self, log_coeffs, log_values):
        # Heinsen (2023): log h_t = a*_t + logcumsumexp(log b_t - a*_t)
        a_star = torch.cumsum(log_coeffs, dim=1)  # expect: AMP004
        log_h = a_star + torch.logcumsumexp(log_values - a_star, dim=1)
        return torch.exp(log_h)

    def forward(self, x):
        seqlen = x.size(1)
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        xs = self.conv1d(xs.transpose(1, 2))[..., :seqlen].transpose(1, 2)
        xs = F.silu(xs)
        log_coeffs = -F.softplus(self.gate_proj(xs))
        # bf16 keeps fp32's exponent range: 1e-8 does not flush here
        log_values = torch.log(F.softplus(self.value_proj(xs)) + 1e-8)
        h = self.scan(log_coeffs, log_values)
        return self.out_proj(self.norm(h, z))


class ResidualBlock(nn.Module):
    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = MambaMixer(cfg)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class MambaLM(nn.Module):
    def __init__(self, cfg: SSMConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([ResidualBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets=None):
        h = self.embedding(idx)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm_f(h))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return LMOutput(logits=logits, loss=loss)


def get_batch(data, block_size, batch_size):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


@torch.inference_mode()
def evaluate(model, data, block_size, batch_size, eval_iters=20):
    model.eval()
    losses = []
    for _ in range(eval_iters):
        x, y = get_batch(data, block_size, batch_size)
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            out = model(x, y)
            bits = out.logits.log_softmax(-1).mean()
        losses.append(out.loss.item())
    model.train()
    return float(np.mean(losses)), bits.item()


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0):
    model.eval()
    for _ in range(max_new_tokens):
        out = model(idx[:, -512:])
        probs = F.softmax(out.logits[:, -1, :] / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1)], dim=1)
    return idx


def lr_at(it, warmup, max_iters, base_lr):
    if it < warmup:
        return base_lr * (it + 1) / warmup
    ratio = (it - warmup) / max(1, max_iters - warmup)
    return 0.1 * base_lr + 0.45 * base_lr * (1.0 + math.cos(math.pi * ratio))


def train(args):
    torch.manual_seed(args.seed)
    train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint8, mode="r")
    val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint8, mode="r")
    model = MambaLM(SSMConfig(n_layer=args.n_layer, d_model=args.d_model))
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    best_val = 1e9
    t0 = time.time()
    for it in range(args.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it, args.warmup, args.max_iters, args.lr)
        x, y = get_batch(train_data, args.block_size, args.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, y)
            # PaLM z-loss keeps the softmax normaliser close to 0
            z_loss = torch.logsumexp(out.logits, dim=-1).pow(2).mean()  # expect: AMP004
            loss = out.loss + args.z_loss_coef * z_loss
            with torch.no_grad():
                probs = out.logits.softmax(-1)
                tok_ent = -(probs * torch.log(probs + 1e-8)).sum(-1)  # expect: AMP004
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % args.log_every == 0:
            ent = tok_ent.float().mean().item()
            print(f"it {it} loss {loss.item():.4f} z {z_loss.item():.3f} ent {ent:.3f} {time.time() - t0:.1f}s")
        if it > 0 and it % args.eval_every == 0:
            val_loss, _ = evaluate(model, val_data, args.block_size, args.batch_size)
            if val_loss < best_val:
                best_val = val_loss
                torch.save(model.state_dict(), os.path.join(args.out_dir, "ckpt.pt"))
    return best_val


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/shakespeare_char")
    p.add_argument("--out_dir", default="out-mamba")
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--max_iters", type=int, default=5000)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--z_loss_coef", type=float, default=1e-4)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--seed", type=int, default=1337)
    train(p.parse_args())
