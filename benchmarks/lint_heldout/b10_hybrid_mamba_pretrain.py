"""
Pretrain a small hybrid Mamba LM: selective-SSM mixer blocks with one causal attention block
every `--attn_every` layers. Data is nanoGPT's uint16 memmap format (train.bin / val.bin).

$ python pretrain_mamba.py --data_dir data/openwebtext --dtype bfloat16 --compile
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


def selective_scan(u, delta, A, B, C, D):
    """Reference sequential scan. Runs in fp32 whatever the input dtype, like the CUDA kernel."""
    dtype_in = u.dtype
    u, delta, B, C = u.float(), delta.float(), B.float(), C.float()
    deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
    deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, u)
    h = u.new_zeros(u.shape[0], u.shape[2], A.shape[1])
    ys = []
    for i in range(u.shape[1]):
        h = deltaA[:, i] * h + deltaB_u[:, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, i]))
    y = torch.stack(ys, dim=1) + u * D
    return y.to(dtype_in)


class MambaMixer(nn.Module):
    def __init__(self, d_model, d_state=16, d_conv=4, expand=2):
        super().__init__()
        d_inner = expand * d_model
        self.d_state, self.dt_rank = d_state, math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, hidden):
        L = hidden.shape[1]
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :L].transpose(1, 2))
        dt, Bm, Cm = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        y = selective_scan(x, dt, -torch.exp(self.A_log.float()), Bm, Cm, self.D.float())
        return self.out_proj(y * F.silu(z))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, block_size):
        super().__init__()
        self.n_head, self.d_model = n_head, d_model
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)
        self.c_proj = nn.Linear(d_model, d_model, bias=False)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, -1e9)  # expect: AMP007
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, d_model, mixer):
        super().__init__()
        self.norm = RMSNorm(d_model)
        self.mixer = mixer

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class HybridMambaLM(nn.Module):
    def __init__(self, vocab_size=50304, d_model=768, n_layer=24, attn_every=6, n_head=12, block_size=4096):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            Block(d_model, CausalSelfAttention(d_model, n_head, block_size) if (i + 1) % attn_every == 0 else MambaMixer(d_model))
            for i in range(n_layer)
        )
        self.norm_f = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def configure_optimizers(model, weight_decay, lr, betas, device_type):
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type == "cuda")


def make_get_batch(data_dir, batch_size, device, device_type):
    def get_batch(split, block_size):
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        if device_type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)
    return get_batch


@torch.no_grad()
def estimate_loss(model, get_batch, ctx, eval_iters, block_size):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, block_size)
            with ctx:
                logits = model(X)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), ignore_index=-1)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def save_release_weights(model, path):
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, path)


def extend_context(model, get_batch, args):
    """Stage 2: continue training at a longer sequence length with a lower LR."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * 0.1, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    for it in range(args.ctx_ext_iters):
        X, Y = get_batch("train", args.ctx_ext_len)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            logits = model(X)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), ignore_index=-1)
            loss.backward()  # expect: AMP008
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 100 == 0:
            print(f"[ctx-ext] iter {it}: loss {loss.item():.4f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/openwebtext")
    p.add_argument("--out_dir", default="out-mamba")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16")
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--grad_accum", type=int, default=40)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--warmup_iters", type=int, default=2000)
    p.add_argument("--max_iters", type=int, default=600000)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--eval_interval", type=int, default=2000)
    p.add_argument("--eval_iters", type=int, default=200)
    p.add_argument("--ctx_ext_iters", type=int, default=0)
    p.add_argument("--ctx_ext_len", type=int, default=4096)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    device_type = "cuda" if "cuda" in args.device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    scaler = torch.amp.GradScaler("cuda", enabled=(args.dtype == "float16"))

    model = HybridMambaLM().to(args.device)
    optimizer = configure_optimizers(model, 0.1, args.lr, (0.9, 0.95), device_type)
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    get_batch = make_get_batch(args.data_dir, args.batch_size, args.device, device_type)

    def get_lr(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / (args.warmup_iters + 1)
        ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (args.lr - args.min_lr)

    best_val_loss = 1e9
    X, Y = get_batch("train", args.block_size)
    t0 = time.time()
    for it in range(args.max_iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        if it % args.eval_interval == 0:
            losses = estimate_loss(model, get_batch, ctx, args.eval_iters, args.block_size)
            print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter": it,
                            "best_val_loss": best_val_loss}, os.path.join(args.out_dir, "ckpt.pt"))

        for micro_step in range(args.grad_accum):
            with ctx:
                logits = model(X)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), ignore_index=-1)  # expect: AMP002
            loss = loss / args.grad_accum
            X, Y = get_batch("train", args.block_size)
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        if it % 10 == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f}, time {dt * 1000:.2f}ms")

    if args.ctx_ext_iters > 0:
        extend_context(model, get_batch, args)
    save_release_weights(raw_model, os.path.join(args.out_dir, "release_bf16.pt"))


if __name__ == "__main__":
    main()
