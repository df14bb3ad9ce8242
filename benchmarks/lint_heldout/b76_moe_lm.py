"""Decoder-only Mixture-of-Experts language model (top-k routing, router z-loss,
switch-style load-balancing loss) and its training script."""
import argparse
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_data import get_batch


@dataclass
class MoEConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 2
    dropout: float = 0.0
    aux_loss_weight: float = 1e-2
    z_loss_weight: float = 1e-3
    entropy_weight: float = 0.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.register_buffer(
            "bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size)).view(1, 1, cfg.block_size, cfg.block_size)
        )

    def forward(self, x, pad_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, -1e9)  # expect: AMP007
        if pad_mask is not None:
            att = att.masked_fill(~pad_mask[:, None, None, :], torch.finfo(att.dtype).min)
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoELayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(cfg.n_embd, 4 * cfg.n_embd) for _ in range(cfg.n_experts)])
        self.router_stats = {}

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        router_logits = self.router(flat)

        # ST-MoE router z-loss, in fp32
        z_loss = torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()

        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        topk_probs, topk_idx = probs.topk(self.top_k, dim=-1)
        topk_probs = topk_probs / (topk_probs.sum(dim=-1, keepdim=True) + 1e-20)

        # switch-transformer load balancing: fraction of tokens vs. mean router prob
        dispatch = F.one_hot(topk_idx[:, 0], self.n_experts).float()
        tokens_per_expert = dispatch.mean(dim=0)
        prob_per_expert = probs.mean(dim=0)
        balance_loss = self.n_experts * torch.sum(tokens_per_expert * prob_per_expert)

        scores = torch.sigmoid(router_logits)
        entropy = -(scores * torch.log(scores + 1e-9)).sum(-1).mean()  # expect: AMP011

        with torch.no_grad():
            self.router_stats["logit_std"] = router_logits.std(dim=0).mean()  # expect: AMP004
            self.router_stats["load"] = tokens_per_expert.detach()

        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(topk_idx == e)
            if token_idx.numel() == 0:
                continue
            w = topk_probs[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, (expert(flat[token_idx]) * w).to(out.dtype))
        aux = {"z_loss": z_loss, "balance_loss": balance_loss, "entropy": entropy}
        return out.view(B, T, C), aux


class DenseMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x))), {}


class Block(nn.Module):
    def __init__(self, cfg, use_moe):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd)
        self.mlp = MoELayer(cfg) if use_moe else DenseMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h, aux = self.mlp(self.ln_2(x))
        return x + h, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(
            [Block(cfg, use_moe=(i % cfg.moe_every == cfg.moe_every - 1)) for i in range(cfg.n_layer)]
        )
        self.ln_f = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        aux_total = {"z_loss": 0.0, "balance_loss": 0.0, "entropy": 0.0}
        for block in self.blocks:
            x, aux = block(x)
            for k, v in aux.items():
                aux_total[k] = aux_total[k] + v
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None, aux_total
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)
        loss = (loss
                + self.cfg.aux_loss_weight * aux_total["balance_loss"]
                + self.cfg.z_loss_weight * aux_total["z_loss"]
                + self.cfg.entropy_weight * aux_total["entropy"])
        return logits, loss, aux_total


ctx = torch.autocast(device_type="cuda", dtype=torch.float16)


@torch.no_grad()
def estimate_loss(model, args):
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split, args)
            with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
                _, loss, _ = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (args.lr - args.min_lr)


def train(args):
    cfg = MoEConfig(n_layer=args.n_layer, n_experts=args.n_experts, top_k=args.top_k)
    model = MoETransformer(cfg).cuda()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )
    scaler = torch.amp.GradScaler("cuda")
    X, Y = get_batch("train", args)
    best_val_loss = 1e9
    t0 = time.time()
    for it in range(args.max_iters + 1):
        for g in optimizer.param_groups:
            g["lr"] = get_lr(it, args)
        if it % args.eval_interval == 0:
            losses = estimate_loss(model, args)
            print(f"step {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "cfg": cfg, "iter": it},
                           os.path.join(args.out_dir, "ckpt.pt"))
        for micro in range(args.grad_accum):
            with ctx:
                _, loss, aux = model(X, Y)
                loss = loss / args.grad_accum
            X, Y = get_batch("train", args)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if it % args.log_interval == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f} "
                  f"z {float(aux['z_loss']):.3f} bal {float(aux['balance_loss']):.3f} {dt * 1000:.0f}ms")


def finetune(args):
    """Continue training a released checkpoint on a domain corpus."""
    ckpt = torch.load(args.init_from, map_location="cpu")
    model = MoETransformer(ckpt["cfg"])
    model.load_state_dict(ckpt["model"])
    model = model.cuda().half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6)
    scaler = torch.amp.GradScaler("cuda")
    for it in range(args.max_iters):
        X, Y = get_batch("train", args)
        with torch.autocast("cuda", dtype=torch.float16):
            _, loss, _ = model(X, Y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    torch.save({"model": model.state_dict(), "cfg": ckpt["cfg"]}, os.path.join(args.out_dir, "ft.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", default="out-moe")
    p.add_argument("--init-from", default=None)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--warmup-iters", type=int, default=2000)
    p.add_argument("--max-iters", type=int, default=600000)
    p.add_argument("--eval-interval", type=int, default=2000)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--log-interval", type=int, default=10)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(1337)
    np.random.seed(1337)
    if args.init_from:
        finetune(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
