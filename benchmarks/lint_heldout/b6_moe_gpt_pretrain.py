"""Pretrain a small sparse mixture-of-experts GPT: top-2 (GShard-style) routing over 8 experts
in every other block, Switch balance and router z-losses. Model and loop in one file, nanoGPT-style.

$ python train_moe.py --dataset openwebtext --precision fp16 --batch_size 12 --max_iters 60000
"""
import argparse
import inspect
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoEConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    n_experts: int = 8
    moe_every: int = 2
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3


class _GatherTokens(torch.autograd.Function):
    """index_select whose backward is an index_add (no dense scatter matrix)."""

    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AMP009
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.n = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad):
        index, = ctx.saved_tensors
        out = grad.new_zeros((ctx.n, grad.shape[1]))
        out.index_add_(0, index, grad)
        return out, None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.attn_dropout, self.resid_dropout = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        causal = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal", causal.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.causal[:, :, :T, :T], -1e10)  # expect: AMP007
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Expert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.w2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.w2(F.gelu(self.w1(x))))


class MoELayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(cfg) for _ in range(cfg.n_experts)])
        self.n_experts = cfg.n_experts
        self.aux_loss = self.z_loss = None

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        logits = self.gate(flat)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        idx1 = probs.argmax(dim=-1)
        mask1 = F.one_hot(idx1, self.n_experts).bool()
        # second expert: best among the others
        logits_except1 = torch.where(mask1, torch.full_like(logits, -1e9), logits)  # expect: AMP007
        idx2 = logits_except1.argmax(dim=-1)
        g1 = probs.gather(1, idx1[:, None]).squeeze(1)
        g2 = probs.gather(1, idx2[:, None]).squeeze(1)
        denom = (g1 + g2).clamp(min=torch.finfo(probs.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
        # Switch-transformer balance loss and ST-MoE z-loss, both in fp32
        density = mask1.float().mean(dim=0)
        density_proxy = probs.mean(dim=0)
        self.aux_loss = (density * density_proxy).sum() * self.n_experts
        self.z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()

        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            for idx, gate in ((idx1, g1), (idx2, g2)):
                sel = (idx == e).nonzero(as_tuple=True)[0]
                if sel.numel() == 0:
                    continue
                y = expert(_GatherTokens.apply(flat, sel)) * gate[sel, None]
                out.index_add_(0, sel, y.to(out.dtype))
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MoELayer(cfg) if moe else Expert(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MoEGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, moe=(i % cfg.moe_every == 1)) for i in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        moe = [blk.mlp for blk in self.transformer.h if isinstance(blk.mlp, MoELayer)]
        return logits, sum(m.aux_loss for m in moe), sum(m.z_loss for m in moe)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **(dict(fused=True) if use_fused else dict()))


def train(args):
    cfg = MoEConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    torch.manual_seed(1337)
    device = args.device
    device_type = "cuda" if "cuda" in device else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    if device_type == "cpu" or args.precision == "fp32":
        ctx = nullcontext()
    elif args.precision == "bf16":
        ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    elif args.precision == "fp16":
        ctx = torch.autocast(device_type=device_type, dtype=torch.float16)  # expect: AMP010
    else:
        raise ValueError(f"unknown precision {args.precision}")

    data_dir = os.path.join("data", args.dataset)

    def get_batch(split):
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - cfg.block_size, (args.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + cfg.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + cfg.block_size].astype(np.int64)) for i in ix])
        if device_type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    model = MoEGPT(cfg)
    iter_num, best_val_loss = 0, 1e9
    if args.init_from == "resume":
        ckpt = torch.load(os.path.join(args.out_dir, "ckpt.pt"), map_location=device)
        state_dict = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
        model.load_state_dict(state_dict)
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
    model.to(device)
    # the experts are 8x the dense MLP: keep them in bf16, router and attention stay fp32
    for block in model.transformer.h:
        if isinstance(block.mlp, MoELayer):
            block.mlp.experts.to(dtype=torch.bfloat16)  # expect: AMP001
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, (args.beta1, args.beta2), device_type)
    if args.init_from == "resume":
        optimizer.load_state_dict(ckpt["optimizer"])
    raw_model = model
    if args.compile:
        model = torch.compile(model)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    logits, _, _ = model(X)
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), ignore_index=-1)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        if it > args.lr_decay_iters:
            return args.min_lr
        ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr)

    os.makedirs(args.out_dir, exist_ok=True)
    X, Y = get_batch("train")
    t0 = time.time()
    while True:
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr

        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": asdict(cfg), "iter_num": iter_num, "best_val_loss": best_val_loss, "config": vars(args)}
                    torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))

        for micro_step in range(args.gradient_accumulation_steps):
            with ctx:
                logits, aux_loss, z_loss = model(X)
            lm_loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), ignore_index=-1)  # expect: AMP002
            loss = (lm_loss + cfg.aux_loss_coef * aux_loss + cfg.z_loss_coef * z_loss) / args.gradient_accumulation_steps
            X, Y = get_batch("train")
            loss.backward()
        if args.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if iter_num % args.log_interval == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {iter_num}: loss {loss.item() * args.gradient_accumulation_steps:.4f} (lm {lm_loss.item():.4f} aux {aux_loss.item():.4f}), time {dt * 1000:.2f}ms")
        iter_num += 1
        if iter_num > args.max_iters:
            break


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="openwebtext")
    p.add_argument("--out_dir", default="out-moe")
    p.add_argument("--init_from", default="scratch", choices=["scratch", "resume"])
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true")
    defaults = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=12, gradient_accumulation_steps=40,
                    learning_rate=6e-4, min_lr=6e-5, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, warmup_iters=2000,
                    lr_decay_iters=60000, max_iters=60000, eval_interval=2000, eval_iters=200, log_interval=10)
    for name, value in defaults.items():
        p.add_argument(f"--{name}", type=type(value), default=value)
    train(p.parse_args())
