"""Normalization layers for the pre-norm ablations (RMSNorm, ScaleNorm, fp32 LayerNorm).

Run directly to train a small causal LM with one of them:

    python norm_layers.py --data data/owt_train.bin --norm rms --iters 20000
    python norm_layers.py --check      # compare with plain eager code on half inputs
"""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class ScaleNorm(nn.Module):
    """Nguyen & Salazar (2019): a single learned scale g, x * g / ||x||."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(dim ** 0.5))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).clamp(min=self.eps)
        return (xf * (self.g / norm)).type_as(x)


class Fp32LayerNorm(nn.LayerNorm):
    def forward(self, x):
        out = F.layer_norm(
            x.float(),
            self.normalized_shape,
            self.weight.float() if self.weight is not None else None,
            self.bias.float() if self.bias is not None else None,
            self.eps,
        )
        return out.type_as(x)


NORMS = {"rms": RMSNorm, "scale": ScaleNorm, "ln32": Fp32LayerNorm, "ln": nn.LayerNorm}


class Block(nn.Module):
    def __init__(self, dim, n_heads, norm_cls):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = norm_cls(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = norm_cls(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, depth, n_heads, block_size, norm="rms"):
        super().__init__()
        norm_cls = NORMS[norm]
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.zeros(1, block_size, dim))
        self.blocks = nn.ModuleList([Block(dim, n_heads, norm_cls) for _ in range(depth)])
        self.ln_f = norm_cls(dim)
        nn.init.normal_(self.tok_emb.weight, std=0.02)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb[:, : idx.size(1)]
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)


@torch.no_grad()
def check_numerics(dim=4096, rows=8192, device="cuda"):
    torch.manual_seed(0)
    x = torch.randn(rows, dim, device=device, dtype=torch.float16) * 4.0
    ours_rms = RMSNorm(dim).to(device)(x)
    ours_ln = Fp32LayerNorm(dim, elementwise_affine=False).to(device)(x)

    eager_rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011
    var = x.var(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
    eager_ln = (x - x.mean(dim=-1, keepdim=True)) * torch.rsqrt(var + 1e-10)  # expect: AMP004 AMP011

    ref_rms = RMSNorm(dim).to(device)._norm(x.double())
    ref_ln = F.layer_norm(x.double(), (dim,))
    for name, out, ref in (
        ("rms/ours", ours_rms, ref_rms),
        ("rms/eager", eager_rms, ref_rms),
        ("ln/ours", ours_ln, ref_ln),
        ("ln/eager", eager_ln, ref_ln),
    ):
        err = (out.double() - ref).abs()
        print(f"{name:10s} max abs err {err.max().item():.3e}  mean {err.mean().item():.3e}")


def get_batch(data, block_size, batch_size, device):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/owt_train.bin")
    ap.add_argument("--norm", choices=sorted(NORMS), default="rms")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--z-loss", type=float, default=1e-4)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-interval", type=int, default=100)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    if args.check:
        check_numerics()
        return

    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    data = np.memmap(args.data, dtype=np.uint16, mode="r")
    model = TinyLM(50304, args.dim, args.depth, args.heads, args.block_size, norm=args.norm).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)

    t0 = time.time()
    for it in range(args.iters):
        lr = args.lr * min(1.0, (it + 1) / 1000)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(data, args.block_size, args.batch_size, device)
        with ctx:
            hidden = model(x)
            logits = F.linear(hidden, model.tok_emb.weight)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            z_loss = args.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
            if it % args.log_interval == 0:
                logit_std = logits.std(dim=-1).mean().item()  # expect: AMP004
        (loss + z_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if it % args.log_interval == 0:
            dt = (time.time() - t0) / max(1, it)
            print(f"iter {it}: loss {loss.item():.4f} z {z_loss.item():.2e} "
                  f"logit std {logit_std:.2f} lr {lr:.2e} {dt * 1000:.0f}ms/it")


if __name__ == "__main__":
    main()
