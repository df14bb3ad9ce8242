"""
Pretrain a small GPT on a pre-tokenized corpus (nanoGPT style).

    python b62_nanogpt_pretrain.py --dataset=openwebtext --dtype=bfloat16
    torchrun --standalone --nproc_per_node=8 b62_nanogpt_pretrain.py --compile

The first release wrapped the forward in torch.cuda.amp.autocast; the flags are unchanged.
"""
import argparse
import inspect
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    z_loss: float = 0.0
    window: int = 0


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, always computed in float32."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        out = F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, 1e-5)
        return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, ndim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.window = config.window
        self.flash = hasattr(F, "scaled_dot_product_attention") and config.window == 0
        mask = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x, doc_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash and doc_mask is None:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            if doc_mask is not None:
                # packed sequences: a token only attends inside its own document
                att = att.masked_fill(~doc_mask[:, None, :T, :T], -1e9)  # expect: AMP007
            if self.window > 0:
                far = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-self.window)
                att = att.masked_fill(far, torch.finfo(att.dtype).min)
            att = F.softmax(att.float(), dim=-1).type_as(v)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = RMSNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
                                 nn.Dropout(config.dropout))

    def forward(self, x, doc_mask=None):
        x = x + self.attn(self.ln_1(x), doc_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, doc_ids=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        doc_mask = None
        if doc_ids is not None:
            doc_mask = doc_ids[:, :, None] == doc_ids[:, None, :]
        for block in self.transformer.h:
            x = block(x, doc_mask)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        if self.config.z_loss > 0:
            lse = torch.logsumexp(logits.float(), dim=-1)
            loss = loss + self.config.z_loss * lse.pow(2).mean()
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": nodecay, "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        extra = dict(fused=True) if fused else dict()
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-8, **extra)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            bs = self.config.block_size
            idx_cond = idx if idx.size(1) <= bs else idx[:, -bs:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


def export_half_weights(model, path):
    """Write a compact fp16 copy of the weights for the serving image."""
    state = {k: v.half() for k, v in model.state_dict().items()}
    torch.save(state, path)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--out_dir", default="out")
    p.add_argument("--dataset", default="openwebtext")
    for name, default in [("batch_size", 12), ("block_size", 1024), ("gradient_accumulation_steps", 40),
                          ("max_iters", 600000), ("warmup_iters", 2000), ("lr_decay_iters", 600000),
                          ("eval_interval", 2000), ("eval_iters", 200), ("log_interval", 10)]:
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in [("learning_rate", 6e-4), ("min_lr", 6e-5), ("weight_decay", 1e-1),
                          ("grad_clip", 1.0), ("z_loss", 0.0)]:
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--eval_only", action="store_true")
    default_dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    p.add_argument("--dtype", default=default_dtype, choices=["float32", "bfloat16", "float16"])
    return p.parse_args()


def make_batch_fn(data_dir, block_size, batch_size, device, device_type):
    def get_batch(split):
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        if device_type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)
    return get_batch


@torch.no_grad()
def estimate_loss(model, ctx, get_batch, eval_iters):
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    ratio = min(1.0, (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters))
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


def train(args):
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        init_process_group(backend="nccl")
        ddp_local_rank = int(os.environ["LOCAL_RANK"])
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
        master_process = int(os.environ["RANK"]) == 0
        args.gradient_accumulation_steps //= int(os.environ["WORLD_SIZE"])
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        master_process = True
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    device_type = "cuda" if "cuda" in device else "cpu"
    dtype = args.dtype
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    get_batch = make_batch_fn(os.path.join("data", args.dataset), args.block_size,
                              args.batch_size, device, device_type)

    config = GPTConfig(block_size=args.block_size, z_loss=args.z_loss)
    model = GPT(config).to(device)
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # expect: AMP009
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, (0.9, 0.95), device_type)
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[ddp_local_rank])
    raw_model = model.module if ddp else model

    iter_num, best_val_loss = 0, 1e9
    X, Y = get_batch("train")
    t0 = time.time()
    while True:
        lr = get_lr(iter_num, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0 and master_process:
            losses = estimate_loss(model, ctx, get_batch, args.eval_iters)
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss and iter_num > 0:
                best_val_loss = losses["val"]
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "scaler": scaler.state_dict(), "iter_num": iter_num,
                              "best_val_loss": best_val_loss, "config": vars(args)}
                torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
                export_half_weights(raw_model, os.path.join(args.out_dir, "model_fp16.pt"))
        if iter_num == 0 and args.eval_only:
            break

        for micro_step in range(args.gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == args.gradient_accumulation_steps - 1
            with ctx:
                logits, loss = model(X, Y)
            loss = loss / args.gradient_accumulation_steps
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        if iter_num % args.log_interval == 0 and master_process:
            dt, t0 = time.time() - t0, time.time()
            lossf = loss.item() * args.gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, scale {scaler.get_scale():.0f}")
        iter_num += 1
        if iter_num > args.max_iters:
            break

    if ddp:
        destroy_process_group()


if __name__ == "__main__":
    train(get_args())
