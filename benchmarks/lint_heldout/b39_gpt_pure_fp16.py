"""A small GPT with optional retrieval cross-attention: training (bf16 autocast, or an
experimental pure-fp16 mode), domain fine-tuning, a throughput benchmark, sampling
and an fp16 release export.
"""
import argparse
import copy
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_data import DomainSampler, get_batch


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 50304
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    cross_every: int = 0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.register_buffer("bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size)).view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class ChunkCrossAttention(nn.Module):
    """Cross-attention to retrieved neighbour chunks (RETRO-style)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.kv = nn.Linear(cfg.n_embd, 2 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x, memory, memory_mask):
        B, T, C = x.size()
        S = memory.size(1)
        h = self.n_head
        q = self.q(x).view(B, T, h, C // h).transpose(1, 2)
        k, v = (t.view(B, S, h, C // h).transpose(1, 2) for t in self.kv(memory).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // h)
        att = att.masked_fill(~memory_mask[:, None, None, :], -1e9)  # expect: AMP007
        att = F.softmax(att, dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg, cross=False):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.xattn = ChunkCrossAttention(cfg) if cross else None
        self.ln_2 = RMSNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x, memory=None, memory_mask=None):
        x = x + self.attn(self.ln_1(x))
        if self.xattn is not None and memory is not None:
            x = x + self.xattn(x, memory, memory_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(
            [Block(cfg, cross=cfg.cross_every > 0 and i % cfg.cross_every == 0) for i in range(cfg.n_layer)]
        )
        self.ln_f = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None, memory=None, memory_mask=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, memory, memory_mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


class ParamEMA:
    """EMA of the weights, kept on the side in fp32 for sampling and release."""

    def __init__(self, model, decay=0.999):
        self.decay = decay
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model):
        for k, v in model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].lerp_(v.float(), 1.0 - self.decay)

    def half(self):
        self.shadow = {k: v.half() for k, v in self.shadow.items()}
        return self


@torch.no_grad()
def estimate_loss(model, args, device, ctx):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            x, y = get_batch(split, args, device)
            with ctx:
                _, loss = model(x, y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def train(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPT(GPTConfig(n_layer=args.n_layer, cross_every=args.cross_every)).to(device)
    if args.pure_fp16:
        # experiment: weights and optimizer state in fp16 (see notes/pure_fp16.md)
        model = model.half()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))  # expect: AMP011
    ctx = nullcontext() if device == "cpu" or not args.amp else torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    ema = ParamEMA(model)
    best_val_loss = 1e9
    for it in range(args.max_iters):
        if it % args.eval_interval == 0:
            losses = estimate_loss(model, args, device, ctx)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": model.state_dict(), "config": vars(model.config), "iter": it}, "ckpt.pt")
        x, y = get_batch("train", args, device)
        with ctx:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)
    release = {k: v.half() for k, v in model.state_dict().items()}
    torch.save(release, "model_fp16.pt")
    torch.save(ema.half().shadow, "ema_fp16.pt")
    rounded = {k: v.half().float() for k, v in model.state_dict().items()}
    model.load_state_dict(rounded)
    return model


def finetune_on_domain(ckpt_path, sampler, steps=200, lr=3e-5, device="cuda"):
    ckpt = torch.load(ckpt_path, map_location="cpu")
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    model = model.to(device).half()  # expect: AMP001
    opt = torch.optim.Adam(model.parameters(), lr=lr)  # expect: AMP011
    model.train()
    for _ in range(steps):
        x, y, memory, memory_mask = sampler.sample(device)
        _, loss = model(x, y, memory, memory_mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def benchmark_train_step(model, optimizer, scaler, batch, n_iters=20):
    x, y, memory, memory_mask = batch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_iters):
        with torch.autocast("cuda", dtype=torch.float16):
            _, loss = model(x, y, memory, memory_mask)
            scaler.scale(loss).backward()  # expect: AMP008
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n_iters


@torch.inference_mode()
def generate_text(ckpt_path, prompt_ids, max_new_tokens=200, device="cuda"):
    ckpt = torch.load(ckpt_path, map_location="cpu")
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    model = model.to(device).half().eval()
    idx = torch.tensor(prompt_ids, dtype=torch.long, device=device)[None]
    return model.generate(idx, max_new_tokens, temperature=0.8, top_k=200)[0].tolist()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["train", "finetune", "bench", "sample"], default="train")
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--cross_every", type=int, default=0)
    p.add_argument("--pure_fp16", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--max_iters", type=int, default=5000)
    p.add_argument("--eval_interval", type=int, default=250)
    p.add_argument("--eval_iters", type=int, default=50)
    args = p.parse_args()
    if args.mode == "train":
        train(args)
    elif args.mode == "finetune":
        finetune_on_domain("ckpt.pt", DomainSampler("domain.bin"))
    elif args.mode == "bench":
        net = GPT(GPTConfig(cross_every=2)).cuda()
        opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
        print(benchmark_train_step(net, opt, torch.amp.GradScaler("cuda"), DomainSampler("domain.bin").sample("cuda")))
    else:
        print(generate_text("ckpt.pt", [50256]))
