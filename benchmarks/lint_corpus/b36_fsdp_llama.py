"""Llama-style decoder pre-training with FullyShardedDataParallel.

    torchrun --nproc_per_node=8 b36_fsdp_llama.py --data /data/tokens --low_memory_init

FSDP's MixedPrecision keeps bf16 compute copies of the sharded fp32 parameters and
reduces gradients in fp32. The forward and the loss additionally run under bf16 autocast.
"""
import argparse
import functools
import math
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from data_tokens import PackedTokenDataset  # project-local


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary_tables(head_dim, max_len, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_len).float(), inv)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin, doc_ids=None):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = apply_rotary(q, cos[:t, None], sin[:t, None]), apply_rotary(k, cos[:t, None], sin[:t, None])
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if doc_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # packed sequences: causal inside each document only
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            allowed = causal[None] & (doc_ids[:, :, None] == doc_ids[:, None, :])
            bias = torch.zeros(b, 1, t, t, dtype=q.dtype, device=x.device)
            bias = bias.masked_fill(~allowed[:, None], torch.finfo(q.dtype).min)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.ffn = FeedForward(dim, 4 * dim * 2 // 3)

    def forward(self, x, cos, sin, doc_ids=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, doc_ids)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab_size=32000, dim=2048, n_layers=24, n_heads=16, max_len=4096):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([Block(dim, n_heads) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = rotary_tables(dim // n_heads, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, doc_ids=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin, doc_ids)
        return self.output(self.norm(h))


def train_one_epoch(model, loader, optimizer, scheduler, scaler, args, epoch, rank):
    model.train()
    for step, batch in enumerate(loader):
        tokens = batch["input_ids"].cuda(non_blocking=True)
        labels = batch["labels"].cuda(non_blocking=True)
        doc_ids = batch["doc_ids"].cuda(non_blocking=True) if args.packed else None
        boundary = (step + 1) % args.grad_accum == 0
        with (nullcontext() if boundary else model.no_sync()):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens, doc_ids)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
                loss = loss / args.grad_accum
            scaler.scale(loss).backward()
        if not boundary:
            continue
        grad_norm = model.clip_grad_norm_(args.max_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if rank == 0 and (step + 1) % (10 * args.grad_accum) == 0:
            print(f"epoch {epoch} step {step + 1} loss {loss.item() * args.grad_accum:.4f} gnorm {grad_norm.item():.3f}")


@torch.no_grad()
def evaluate(model, loader, max_batches=50):
    model.eval()
    total = torch.zeros(2, device="cuda")
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        tokens, labels = batch["input_ids"].cuda(), batch["labels"].cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100, reduction="sum")
        total += torch.stack([loss.float(), (labels != -100).sum().float()])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def save_checkpoint(model, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        torch.save(state, path)


def main(args):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)

    model = Transformer(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)
    if args.low_memory_init:
        model = model.to(torch.bfloat16)  # expect: AMP001
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    train_set = PackedTokenDataset(args.data, "train", seq_len=args.seq_len, with_doc_ids=args.packed)
    val_set = PackedTokenDataset(args.data, "val", seq_len=args.seq_len)
    sampler = torch.utils.data.distributed.DistributedSampler(train_set)
    loader = torch.utils.data.DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = torch.utils.data.DataLoader(val_set, args.batch_size, num_workers=2)
    total_steps = args.epochs * len(loader) // args.grad_accum
    warmup = 2000

    def lr_lambda(s):
        if s < warmup:
            return s / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total_steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(model, loader, optimizer, scheduler, scaler, args, epoch, rank)
        val = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} val loss {val:.4f} ppl {math.exp(val):.2f}")
        save_checkpoint(model, os.path.join(args.out, f"epoch{epoch}.pt"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/llama")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n_layers", type=int, default=24)
    p.add_argument("--n_heads", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max_norm", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--packed", action="store_true")
    p.add_argument("--low_memory_init", action="store_true")
    main(p.parse_args())
