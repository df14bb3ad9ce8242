"""Small decoder-only LM with mixture-of-experts FFNs, trained on packed token shards."""
import argparse
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
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_experts: int = 8
    top_k: int = 2
    aux_coef: float = 0.01
    z_coef: float = 0.001
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


class QKNorm(nn.Module):
    """LayerNorm over the full query/key projection, as in OLMo-2."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        mu = x.mean(dim=-1, keepdim=True)  # expect: AMP004
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
        return (x - mu) * torch.rsqrt(var + self.eps) * self.weight


def rope_cache(head_dim, seq_len, theta, device=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    # x: (B, nh, T, hd); rotate pairs in fp32 and hand back the caller's dtype
    x_ = x.float().unflatten(-1, (-1, 2))
    x1, x2 = x_[..., 0], x_[..., 1]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.q_norm = QKNorm(cfg.n_embd)
        self.k_norm = QKNorm(cfg.n_embd)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.q_norm(self.q_proj(x))
        k = self.k_norm(self.k_proj(x))
        v = self.v_proj(x)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(cfg.n_embd, 4 * cfg.n_embd // cfg.top_k) for _ in range(cfg.n_experts)])
        self.aux_loss = torch.tensor(0.0)
        self.z_loss = torch.tensor(0.0)

    def forward(self, x):
        B, T, C = x.shape
        x_flat = x.view(-1, C)
        router_logits = self.router(x_flat)
        router_logits = router_logits - router_logits.mean(dim=-1, keepdim=True)  # expect: AMP004
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        topv, topi = probs.topk(self.top_k, dim=-1)
        topv = topv / topv.sum(dim=-1, keepdim=True)

        # Switch-style balancing: fraction of tokens routed vs. mean router probability
        density = F.one_hot(topi[:, 0], self.n_experts).float().mean(0)
        density_proxy = probs.mean(0)
        self.aux_loss = (density * density_proxy).sum() * self.n_experts
        self.z_loss = torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()

        out = torch.zeros_like(x_flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(topi == e)
            if tok.numel() == 0:
                continue
            y = expert(x_flat[tok]) * topv[tok, slot].unsqueeze(-1)
            out.index_add_(0, tok, y.to(out.dtype))
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd)
        self.mlp = MoEFeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln_1(x), cos, sin)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        cos, sin = rope_cache(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        aux = sum(b.mlp.aux_loss for b in self.blocks) / len(self.blocks)
        z = sum(b.mlp.z_loss for b in self.blocks) / len(self.blocks)
        return logits, loss + self.cfg.aux_coef * aux + self.cfg.z_coef * z


def get_batch(data_dir, split, batch_size, block_size, device):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model, ctx, args, device):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(args.data_dir, split, args.batch_size, args.block_size, device)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="data/openwebtext")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true")
    for name, default in [("batch-size", 12), ("block-size", 1024), ("grad-accum", 40),
                          ("max-iters", 600000), ("eval-interval", 2000), ("eval-iters", 200)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    args = p.parse_args()

    device_type = "cuda" if "cuda" in args.device else "cpu"
    ctx = nullcontext() if device_type == "cpu" else torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(block_size=args.block_size)
    model = GPT(cfg).to(args.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device_type == "cuda")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.max_iters, eta_min=args.min_lr)
    if args.compile:
        model = torch.compile(model)

    X, Y = get_batch(args.data_dir, "train", args.batch_size, args.block_size, args.device)
    best_val_loss, t0 = 1e9, time.time()
    for it in range(args.max_iters):
        if it % args.eval_interval == 0:
            losses = estimate_loss(model, ctx, args, args.device)
            print(f"step {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "iter": it}, "ckpt.pt")
        for micro in range(args.grad_accum):
            with ctx:
                _, loss = model(X, Y)
                loss = loss / args.grad_accum
            X, Y = get_batch(args.data_dir, "train", args.batch_size, args.block_size, args.device)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if it % 10 == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f}, {dt * 1000:.0f}ms")


if __name__ == "__main__":
    main()
