"""Sparse mixture-of-experts decoder-only LM (nanoGPT layout, MoE every other block).

Routing: sigmoid affinities, top-k experts per token chosen with a per-expert
bias (auxiliary-loss-free balancing), combine weights renormalised over the k
picks.  Two auxiliary terms are still trained: the Switch load-balancing loss
and the ST-MoE router z-loss.  Router parameters get their own optimizer.

Training: CUDA fp16 autocast through a module-level context, GradScaler,
gradient accumulation, optional torch.compile.
"""
import argparse
import math
import time
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

RouterOutput = namedtuple("RouterOutput", ["logits", "scores", "weights", "indices"])


@dataclass
class MoEConfig:
    vocab_size: int = 50304
    block_size: int = 512
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512
    n_expert: int = 8
    top_k: int = 2
    expert_hidden: int = 1024
    moe_every: int = 2
    dropout: float = 0.0
    aux_coef: float = 1e-2
    z_coef: float = 1e-3


def router_z_loss(logits):
    z = torch.logsumexp(logits.float(), dim=-1)
    return (z ** 2).mean()


def load_balancing_loss(scores, indices, n_expert):
    counts = F.one_hot(indices, n_expert).sum(dim=1).float()
    density = counts.mean(dim=0) / indices.size(1)
    density_proxy = scores.mean(dim=0)  # expect: AMP004
    return n_expert * (density * density_proxy).sum()


def binary_entropy(p):
    logp = torch.log(p + 1e-9)  # expect: AMP011
    log1mp = torch.log(1.0 - p + 1e-9)  # expect: AMP011
    return -(p * logp + (1.0 - p) * log1mp)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
        self.register_buffer("causal", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, -1e9 if att.dtype == torch.float32 else -1e4)
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Expert(nn.Module):
    def __init__(self, n_embd, hidden):
        super().__init__()
        self.w1 = nn.Linear(n_embd, hidden, bias=False)
        self.w3 = nn.Linear(n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SigmoidTopKRouter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.top_k = cfg.top_k
        self.register_buffer("expert_bias", torch.zeros(cfg.n_expert))

    def forward(self, x):
        logits = self.gate(x)
        scores = torch.sigmoid(logits)
        _, indices = (scores + self.expert_bias).topk(self.top_k, dim=-1)
        picked = scores.gather(-1, indices)
        weights = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
        return RouterOutput(logits, scores, weights, indices)


class MoELayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.router = SigmoidTopKRouter(cfg)
        self.experts = nn.ModuleList(Expert(cfg.n_embd, cfg.expert_hidden) for _ in range(cfg.n_expert))
        self.n_expert = cfg.n_expert

    def _dispatch(self, x, route):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(route.indices == e)
            if token_idx.numel() == 0:
                continue
            y = expert(x[token_idx]) * route.weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def forward(self, x):
        b, t, c = x.shape
        flat = x.reshape(-1, c)
        route = self.router(flat)
        out = self._dispatch(flat, route)
        entropy = binary_entropy(route.scores).sum(dim=-1)
        aux = {
            "balance": load_balancing_loss(route.scores, route.indices, self.n_expert),
            "z": router_z_loss(route.logits),
            "entropy": entropy.mean().detach(),
        }
        return out.view(b, t, c), aux


class DenseFFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x):
        return self.net(x), {}


class Block(nn.Module):
    def __init__(self, cfg, use_moe):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.ffn = MoELayer(cfg) if use_moe else DenseFFN(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h, aux = self.ffn(self.ln_2(x))
        return x + h, aux


class MoELM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg, use_moe=(i % cfg.moe_every == cfg.moe_every - 1)) for i in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        balance, z_terms, entropy = [], [], []
        for block in self.blocks:
            x, aux = block(x)
            if aux:
                balance.append(aux["balance"])
                z_terms.append(aux["z"])
                entropy.append(aux["entropy"])
        logits = self.lm_head(self.ln_f(x))
        out = {"logits": logits}
        if targets is not None:
            ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            aux_loss = self.cfg.aux_coef * torch.stack(balance).mean() + self.cfg.z_coef * torch.stack(z_terms).mean()
            out["loss"] = ce + aux_loss
            out["ce"] = ce.detach()
            out["router_entropy"] = torch.stack(entropy).mean()
        return out


ctx = torch.autocast(device_type="cuda", dtype=torch.float16)


def get_batch(data, block_size, batch_size, device="cuda"):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss(model, data, cfg, args):
    model.eval()
    losses = torch.zeros(args.eval_iters)
    for k in range(args.eval_iters):
        x, y = get_batch(data, cfg.block_size, args.batch_size)
        with ctx:
            out = model(x, y)
        losses[k] = out["ce"].item()
    model.train()
    return losses.mean().item()


def train(cfg, args, train_data, val_data):
    torch.manual_seed(1337)
    model = MoELM(cfg)
    model.to("cuda")
    router_params = [p for n, p in model.named_parameters() if ".router." in n]
    other_params = [p for n, p in model.named_parameters() if ".router." not in n]
    optimizer = torch.optim.AdamW(other_params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    router_opt = torch.optim.SGD(router_params, lr=args.router_lr, momentum=0.9)
    try:
        scaler = torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler()
    if args.compile:
        model = torch.compile(model)

    best_val = 1e9
    t0 = time.time()
    for it in range(args.max_iters):
        lr = get_lr(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(args.accum_steps):
            x, y = get_batch(train_data, cfg.block_size, args.batch_size)
            with ctx:
                out = model(x, y)
                loss = out["loss"] / args.accum_steps
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(other_params, args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        router_opt.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
        router_opt.zero_grad(set_to_none=True)

        if it % args.log_interval == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it}: loss {loss.item() * args.accum_steps:.4f}, "
                  f"entropy {out['router_entropy'].item():.3f}, {dt * 1000:.0f}ms")
        if it % args.eval_interval == 0 and it > 0:
            val = estimate_loss(model, val_data, cfg, args)
            if val < best_val:
                best_val = val
                torch.save({"model": model.state_dict(), "iter": it, "val": val}, "moe_ckpt.pt")
    return best_val


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", dest="min_lr", type=float, default=6e-5)
    p.add_argument("--router-lr", dest="router_lr", type=float, default=1e-3)
    p.add_argument("--warmup-iters", dest="warmup_iters", type=int, default=500)
    p.add_argument("--max-iters", dest="max_iters", type=int, default=20000)
    p.add_argument("--accum-steps", dest="accum_steps", type=int, default=8)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=12)
    p.add_argument("--grad-clip", dest="grad_clip", type=float, default=1.0)
    p.add_argument("--eval-iters", dest="eval_iters", type=int, default=50)
    p.add_argument("--eval-interval", dest="eval_interval", type=int, default=500)
    p.add_argument("--log-interval", dest="log_interval", type=int, default=10)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    cfg = MoEConfig()
    train_data = np.random.randint(0, cfg.vocab_size, size=1_000_000, dtype=np.uint16)
    val_data = np.random.randint(0, cfg.vocab_size, size=100_000, dtype=np.uint16)
    train(cfg, args, train_data, val_data)


if __name__ == "__main__":
    main()
