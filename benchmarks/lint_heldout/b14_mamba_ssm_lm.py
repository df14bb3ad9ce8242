"""Small Mamba (selective state space) language model, nanoGPT-style training loop.

The selective scan is a reference implementation in PyTorch wrapped in a custom
autograd function so the state sequence is not kept by autograd twice.
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MambaConfig:
    vocab_size: int = 50304
    d_model: int = 512
    n_layer: int = 16
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int = 32
    dt_min: float = 1e-3
    dt_max: float = 1e-1


@dataclass
class TrainConfig:
    data_dir: str = "data/openwebtext"
    out_dir: str = "out-mamba"
    batch_size: int = 8
    seq_len: int = 1024
    grad_accum: int = 8
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 2000
    max_iters: int = 60000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 1000
    eval_iters: int = 100
    compile: bool = True


class SelectiveScanFn(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, u, delta, A, B, C, D):
        # u, delta: [b, d, l]   A: [d, n]   B, C: [b, n, l]   D: [d]
        deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
        hs = []
        for i in range(u.shape[2]):
            h = deltaA[:, :, i] * h + deltaB_u[:, :, i]
            hs.append(h)
        hs = torch.stack(hs, dim=2)
        y = torch.einsum("bdln,bnl->bdl", hs, C) + u * D[None, :, None]
        ctx.save_for_backward(u, delta, A, B, C, D, hs, deltaA)
        return y

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, dy):
        u, delta, A, B, C, D, hs, deltaA = ctx.saved_tensors
        dC = torch.einsum("bdl,bdln->bnl", dy, hs)
        dD = (dy * u).sum(dim=(0, 2))
        dh = torch.zeros_like(hs[:, :, 0])
        d_deltaA = torch.zeros_like(deltaA)
        d_deltaBu = torch.zeros_like(deltaA)
        for i in reversed(range(u.shape[2])):
            dh = dh + dy[:, :, i, None] * C[:, None, :, i]
            d_deltaBu[:, :, i] = dh
            if i > 0:
                d_deltaA[:, :, i] = dh * hs[:, :, i - 1]
            dh = dh * deltaA[:, :, i]
        d_dA = d_deltaA * deltaA
        d_delta = torch.einsum("bdln,dn->bdl", d_dA, A) + torch.einsum("bdln,bnl,bdl->bdl", d_deltaBu, B, u)
        dA = torch.einsum("bdln,bdl->dn", d_dA, delta)
        dB = torch.einsum("bdln,bdl,bdl->bnl", d_deltaBu, delta, u)
        du = dy * D[None, :, None] + torch.einsum("bdln,bdl,bnl->bdl", d_deltaBu, delta, B)
        return du, d_delta, dA, dB, dC, dD


def selective_scan(u, delta, A, B, C, D):
    return SelectiveScanFn.apply(u, delta, A, B, C, D)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class MambaMixer(nn.Module):
    def __init__(self, cfg: MambaConfig):
        super().__init__()
        d_inner = cfg.expand * cfg.d_model
        self.dt_rank, self.d_state = cfg.dt_rank, cfg.d_state
        self.in_proj = nn.Linear(cfg.d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, cfg.d_conv, groups=d_inner, padding=cfg.d_conv - 1)
        self.x_proj = nn.Linear(d_inner, cfg.dt_rank + 2 * cfg.d_state, bias=False)
        self.dt_proj = nn.Linear(cfg.dt_rank, d_inner)
        A = torch.arange(1, cfg.d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=False)
        dt = torch.exp(torch.rand(d_inner) * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
        dt = dt.clamp(min=1e-4)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x):
        b, l, _ = x.shape
        x_in, z = self.in_proj(x).chunk(2, dim=-1)
        x_in = F.silu(self.conv1d(x_in.transpose(1, 2))[..., :l])
        dt, B, C = torch.split(self.x_proj(x_in.transpose(1, 2)), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt)).transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        y = selective_scan(x_in, delta, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float())
        return self.out_proj(y.transpose(1, 2) * F.silu(z))


class ResidualBlock(nn.Module):
    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model)
        self.mixer = MambaMixer(cfg)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class MambaLM(nn.Module):
    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([ResidualBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, idx):
        x = self.embedding(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            logits = self(idx)[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


def configure_optimizers(model, weight_decay, lr, betas):
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


def get_lr(it, tc: TrainConfig):
    if it < tc.warmup_iters:
        return tc.lr * (it + 1) / (tc.warmup_iters + 1)
    if it > tc.max_iters:
        return tc.min_lr
    ratio = (it - tc.warmup_iters) / (tc.max_iters - tc.warmup_iters)
    return tc.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (tc.lr - tc.min_lr)


def make_batch_fn(tc: TrainConfig, device):
    def get_batch(split):
        data = np.memmap(os.path.join(tc.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - tc.seq_len, (tc.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + tc.seq_len].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + tc.seq_len].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return get_batch


@torch.no_grad()
def estimate_loss(model, ctx, get_batch, eval_iters):
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits = model(X)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def apply_gradients(model, optimizer, scaler, max_norm):
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm > 0 else None
    scaler.step(optimizer)  # expect: AMP006
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train(tc: TrainConfig, mc: MambaConfig):
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    get_batch = make_batch_fn(tc, device)

    model = MambaLM(mc).to(device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    optimizer = configure_optimizers(model, tc.weight_decay, tc.lr, (0.9, 0.95))
    raw_model = model
    if tc.compile:
        model = torch.compile(model)

    best_val_loss = 1e9
    X, Y = get_batch("train")
    t0 = time.time()
    for it in range(tc.max_iters + 1):
        lr = get_lr(it, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % tc.eval_interval == 0:
            losses = estimate_loss(model, ctx, get_batch, tc.eval_iters)
            print(f"iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "config": mc.__dict__, "iter": it}, os.path.join(tc.out_dir, "ckpt.pt"))

        for micro_step in range(tc.grad_accum):
            with ctx:
                logits = model(X)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1)) / tc.grad_accum
                logit_std = logits.std(dim=-1).mean()  # expect: AMP004
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        grad_norm = apply_gradients(model, optimizer, scaler, tc.grad_clip)

        if it % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it}: loss {loss.item() * tc.grad_accum:.4f} logit_std {logit_std.item():.3f} "
                  f"gnorm {float(grad_norm):.3f} lr {lr:.2e} {dt * 100:.0f}ms/iter")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=TrainConfig.data_dir)
    ap.add_argument("--out-dir", default=TrainConfig.out_dir)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--n-layer", type=int, default=MambaConfig.n_layer)
    a = ap.parse_args()
    tcfg = TrainConfig(data_dir=a.data_dir, out_dir=a.out_dir, compile=not a.no_compile)
    os.makedirs(tcfg.out_dir, exist_ok=True)
    train(tcfg, MambaConfig(n_layer=a.n_layer))
