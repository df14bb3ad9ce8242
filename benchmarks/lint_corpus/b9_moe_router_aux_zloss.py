"""Small sparse mixture-of-experts GPT: top-k sigmoid router, load-balancing aux loss, router z-loss.

Single file, nanoGPT layout. Trains on a uint16 token memmap.

    python train_moe.py --data data/owt --n-expert 16 --top-k 2 --batch-size 16 --grad-accum 8
"""
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

AMP_DTYPE = torch.float16  # the cluster is V100: no bf16


@dataclass
class MoEConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512
    n_expert: int = 16
    top_k: int = 2
    expert_mult: int = 2
    seq_aux: bool = False
    router_noise: float = 0.0
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = torch.full((T, T), -1e10, device=x.device, dtype=att.dtype).triu(1)  # expect: AMP007
        att = F.softmax(att + causal, dim=-1)
        y = self.drop(att) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class TopKRouter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_expert, self.top_k = cfg.n_expert, cfg.top_k
        self.seq_aux = cfg.seq_aux
        self.noise = cfg.router_noise
        self.gate = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        logits = self.gate(x.view(-1, C))  # (B*T, E)
        if self.training and self.noise > 0:
            logits = logits + torch.randn_like(logits) * self.noise
        scores = torch.sigmoid(logits)
        topk_w, topk_idx = scores.topk(self.top_k, dim=-1)
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)

        # load balancing: fraction of tokens routed to each expert times its mean router probability
        chosen = F.one_hot(topk_idx, self.n_expert).sum(dim=1).float()  # (B*T, E)
        if self.seq_aux:
            f = chosen.view(B, T, -1).mean(dim=1) * self.n_expert / self.top_k
            p = scores.view(B, T, -1).mean(dim=1)  # expect: AMP004
            aux_loss = (f * p).sum(dim=-1).mean()
        else:
            f = chosen.mean(dim=0) * self.n_expert / self.top_k
            p = scores.mean(dim=0)  # expect: AMP004
            aux_loss = (f * p).sum()
        # ST-MoE router z-loss keeps the gate logits small
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        entropy = -(scores * torch.log(scores + 1e-9)).sum(dim=-1).mean()  # expect: AMP011
        return topk_w, topk_idx, aux_loss, z_loss, entropy


class Expert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.expert_mult * cfg.n_embd
        self.w1 = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoELayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.router = TopKRouter(cfg)
        self.experts = nn.ModuleList([Expert(cfg) for _ in range(cfg.n_expert)])

    def forward(self, x):
        B, T, C = x.shape
        w, idx, aux, z, ent = self.router(x)
        flat = x.view(-1, C)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, (expert(flat[tok]) * w[tok, slot, None]).to(out.dtype))
        return out.view(B, T, C), aux, z, ent


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.moe = MoELayer(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h, aux, z, ent = self.moe(self.ln_2(x))
        return x + h, aux, z, ent


class MoEGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        aux_total = z_total = ent_total = 0.0
        for block in self.blocks:
            x, aux, z, ent = block(x)
            aux_total, z_total, ent_total = aux_total + aux, z_total + z, ent_total + ent
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        n = len(self.blocks)
        return logits, loss, aux_total / n, z_total / n, ent_total / n


def get_batch(data_dir, split, batch_size, block_size, device):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model, args, ctx, eval_iters=50):
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(args.data, split, args.batch_size, args.block_size, "cuda")
            with ctx:
                _, loss, _, _, _ = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/owt")
    p.add_argument("--out", default="out-moe")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--max-iters", type=int, default=100_000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--n-expert", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--aux-coef", type=float, default=1e-2)
    p.add_argument("--z-coef", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--eval-interval", type=int, default=1000)
    args = p.parse_args()

    torch.manual_seed(1337)
    use_amp = not args.no_amp
    ctx = torch.autocast(device_type="cuda", dtype=AMP_DTYPE) if use_amp else nullcontext()
    scaler = torch.cuda.amp.GradScaler() if use_amp else None  # expect: AMP009

    cfg = MoEConfig(block_size=args.block_size, n_expert=args.n_expert, top_k=args.top_k)
    model = MoEGPT(cfg).cuda()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )
    os.makedirs(args.out, exist_ok=True)
    best_val_loss = 1e9
    X, Y = get_batch(args.data, "train", args.batch_size, args.block_size, "cuda")
    t0 = time.time()
    for it in range(args.max_iters):
        lr = args.lr * min(1.0, (it + 1) / 2000) * 0.5 * (1 + math.cos(math.pi * it / args.max_iters))
        for g in optimizer.param_groups:
            g["lr"] = lr
        if it % args.eval_interval == 0 and it > 0:
            losses = estimate_loss(model, args, ctx)
            print(f"iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "cfg": cfg, "iter": it}, os.path.join(args.out, "ckpt.pt"))

        for micro in range(args.grad_accum):
            with ctx:
                logits, lm_loss, aux, z, ent = model(X, Y)
                loss = (lm_loss + args.aux_coef * aux + args.z_coef * z) / args.grad_accum
                X, Y = get_batch(args.data, "train", args.batch_size, args.block_size, "cuda")
                if scaler is not None:
                    scaler.scale(loss).backward()  # expect: AMP008
                else:
                    loss.backward()  # expect: AMP008
        if scaler is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)

        if it % 10 == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f} aux {aux.item():.4f} "
                  f"z {z.item():.3f} router-entropy {ent.item():.3f} {dt * 1000:.0f}ms")


if __name__ == "__main__":
    main()
