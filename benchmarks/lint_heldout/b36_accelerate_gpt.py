"""Continued pre-training of a small GPT with Hugging Face accelerate.

`accelerate launch --mixed_precision bf16 b36_accelerate_gpt.py ...`: accelerate owns
autocast (accelerator.autocast()), gradient accumulation, the scaled backward and the
clipping. The MLP uses a hand-written SwiGLU autograd function that recomputes its
activations in backward to save memory.
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class RecomputeSwiGLU(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AMP009
    def forward(ctx, x, w_gate, w_up):
        ctx.save_for_backward(x, w_gate, w_up)
        return F.silu(x @ w_gate.t()) * (x @ w_up.t())

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        x, w_gate, w_up = ctx.saved_tensors
        g = x @ w_gate.t()
        u = x @ w_up.t()
        sig = torch.sigmoid(g)
        d_u = grad_out * g * sig
        d_g = grad_out * u * sig * (1 + g * (1 - sig))
        x2 = x.reshape(-1, x.size(-1))
        d_x = d_g @ w_gate + d_u @ w_up
        d_wg = d_g.reshape(-1, d_g.size(-1)).t() @ x2
        d_wu = d_u.reshape(-1, d_u.size(-1)).t() @ x2
        return d_x, d_wg, d_wu


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(hidden, dim).normal_(std=0.02))
        self.w_up = nn.Parameter(torch.empty(hidden, dim).normal_(std=0.02))
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(RecomputeSwiGLU.apply(x, self.w_gate, self.w_up))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads, block_size):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, dim, heads, block_size):
        super().__init__()
        self.ln1 = RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block_size)
        self.ln2 = RMSNorm(dim)
        self.mlp = MLP(dim, int(8 * dim / 3))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, dim=768, depth=12, heads=12, block_size=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, block_size) for _ in range(depth)])
        self.ln_f = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.data[i * self.block_size : (i + 1) * self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


@torch.no_grad()
def evaluate(model, loader, accelerator, max_batches=200):
    model.eval()
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        with accelerator.autocast():
            _, loss = model(x, y)
        losses.append(accelerator.gather_for_metrics(loss.detach().repeat(x.size(0))))
    model.train()
    mean = torch.cat(losses).float().mean().item()
    return mean, math.exp(min(mean, 20))


def save_release_checkpoint(accelerator, model, path):
    state = {k: v.to(torch.bfloat16) for k, v in accelerator.get_state_dict(model).items()}
    accelerator.save(state, path)


def training_function(args):
    accelerator = Accelerator(
        mixed_precision="bf16", gradient_accumulation_steps=args.grad_accum, log_with="tensorboard", project_dir=args.out
    )
    set_seed(args.seed)
    model = GPT(block_size=args.block_size)
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu"))
    model = model.to(torch.bfloat16)  # expect: AMP001
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    train_dl = torch.utils.data.DataLoader(TokenDataset(args.train_bin, args.block_size), args.batch_size, shuffle=True)
    val_dl = torch.utils.data.DataLoader(TokenDataset(args.val_bin, args.block_size), args.batch_size)
    total = len(train_dl) * args.epochs // args.grad_accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.02)
    model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, val_dl, scheduler)
    accelerator.init_trackers("gpt-cpt")

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_dl:
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    logits, loss = model(x, y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                step += 1
                if step % args.log_every == 0:
                    accelerator.log({"train/loss": loss.item(), "grad_norm": grad_norm.item()}, step=step)
                if step % args.eval_every == 0:
                    val_loss, ppl = evaluate(model, val_dl, accelerator)
                    accelerator.log({"val/loss": val_loss, "val/ppl": ppl}, step=step)
                    accelerator.wait_for_everyone()
                    if accelerator.is_main_process:
                        save_release_checkpoint(accelerator, model, os.path.join(args.out, f"step{step}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--train_bin", required=True)
    p.add_argument("--val_bin", required=True)
    p.add_argument("--out", default="runs/gpt")
    p.add_argument("--init_from", default="")
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1337)
    training_function(p.parse_args())
