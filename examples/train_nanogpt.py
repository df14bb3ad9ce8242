"""A nanoGPT-style training script, small enough to train on a CPU in seconds.

It keeps the idioms of Karpathy's nanoGPT ``train.py`` that a runtime guard has to live with:
``scaler = GradScaler(enabled=(dtype == "float16"))`` called unconditionally (a disabled scaler in
bfloat16), ``ctx = nullcontext()`` on the CPU (``--cpu-autocast`` uses autocast there too),
gradient accumulation over micro-steps with the next batch fetched between forward and backward,
``torch.compile`` (``--compile``), an ``estimate_loss()`` under ``torch.no_grad()`` switching
``model.eval()`` / ``model.train()``, and a checkpoint saved to ``--out-dir``.

    python examples/train_nanogpt.py --dtype bfloat16 --max-iters 20
    python -m amp_runtime run examples/train_nanogpt.py --dtype float16 --cpu-autocast

The data is a synthetic, deterministic token stream (a noisy repeating pattern), so runs repeat
exactly and the loss falls. ``flake8 --select=AMP`` finds nothing here.
"""
import argparse
import math
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- the model (nanoGPT's model.py, shrunk) -------------------------------------------------------

class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, as in nanoGPT."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head

    def forward(self, x):
        batch, length, width = x.size()
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, width))


class MLP(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = LayerNorm(n_embd, bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias=True):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        positions = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """AdamW with weight decay on the matrices only, as nanoGPT does."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# -- training (nanoGPT's train.py) ---------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="training precision; float16 also enables the GradScaler")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpu-autocast", action="store_true",
                        help="use torch.autocast on the CPU too (nanoGPT uses nullcontext() there)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (default: inductor)")
    parser.add_argument("--max-iters", type=int, default=8)
    parser.add_argument("--eval-interval", type=int, default=4)
    parser.add_argument("--eval-iters", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--warmup-iters", type=int, default=2)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--out-dir", default="out-nanogpt",
                        help="where ckpt.pt is saved (default: out-nanogpt/)")
    parser.add_argument("--seed", type=int, default=1337)
    return parser.parse_args(argv)


def token_stream(vocab_size, length, seed):
    """A repeating pattern with 10% random tokens: learnable, deterministic."""
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.randint(vocab_size, (37,), generator=generator)
    data = pattern.repeat(length // len(pattern) + 1)[:length]
    noise = torch.rand(length, generator=generator) < 0.1
    return torch.where(noise, torch.randint(vocab_size, (length,), generator=generator), data)


def main(argv=None):
    """Train; return the loss printed at each iteration (the last micro-step's, as nanoGPT)."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device_type = "cuda" if "cuda" in args.device else "cpu"
    dtype = args.dtype
    ptdtype = DTYPES[dtype]
    autocast_here = device_type != "cpu" or args.cpu_autocast
    ctx = nullcontext() if not autocast_here else torch.amp.autocast(
        device_type=device_type, dtype=ptdtype)

    data = token_stream(args.vocab_size, 4096, args.seed)
    splits = {"train": data[:3686], "val": data[3686:]}  # 90% / 10%, as nanoGPT
    batches = torch.Generator().manual_seed(args.seed)

    def get_batch(split):
        data = splits[split]
        starts = torch.randint(len(data) - args.block_size, (args.batch_size,), generator=batches)
        x = torch.stack([data[i:i + args.block_size] for i in starts])
        y = torch.stack([data[i + 1:i + 1 + args.block_size] for i in starts])
        return x.to(args.device), y.to(args.device)

    model_args = dict(vocab_size=args.vocab_size, block_size=args.block_size,
                      n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(**model_args).to(args.device)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(0.1, args.learning_rate, (0.9, 0.95))
    raw_model = model
    if args.compile:
        model = torch.compile(model, backend=args.compile_backend)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
        return args.learning_rate * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(ratio, 1.0))))

    os.makedirs(args.out_dir, exist_ok=True)
    best_val_loss = 1e9
    printed = []
    X, Y = get_batch("train")
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.6f}, val loss {losses['val']:.6f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "model_args": model_args,
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
        for micro_step in range(args.gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / args.gradient_accumulation_steps
            X, Y = get_batch("train")  # fetch the next batch while the backward runs
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * args.gradient_accumulation_steps
        printed.append(lossf)
        print(f"iter {iter_num}: loss {lossf:.6f}, lr {lr:.3e}")
        iter_num += 1
        if iter_num > args.max_iters:
            break
    torch.save({"model": raw_model.state_dict(), "iter_num": iter_num},
               os.path.join(args.out_dir, "final.pt"))
    return printed


if __name__ == "__main__":
    main()
