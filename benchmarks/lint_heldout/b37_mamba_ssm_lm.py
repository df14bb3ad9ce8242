"""Selective state-space language model (Mamba-style) with a reference scan.

Each mixer: input projection -> causal depthwise conv -> input-dependent
(delta, B, C) -> selective scan -> SiLU gate -> output projection.  B and C are
RMS-normalised per token (as in Jamba / Falcon-Mamba) for stability at scale.

Pre-training runs under CUDA fp16 autocast with a GradScaler; a second, short
long-context phase reuses the model.
"""
import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SSMConfig:
    vocab_size: int = 50304
    d_model: int = 512
    n_layer: int = 12
    d_state: int = 16
    expand: int = 2
    d_conv: int = 4
    dt_rank: int = 32
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    bc_norm: bool = True


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def selective_scan(u, delta, A, B, C, D):
    """Sequential reference scan.

    u, delta: [b, l, d]; A: [d, n]; B, C: [b, l, n]; D: [d].
    """
    b, l, d = u.shape
    deltaA = torch.exp(delta.unsqueeze(-1) * A)
    deltaB_u = delta.unsqueeze(-1) * B.unsqueeze(2) * u.unsqueeze(-1)
    h = torch.zeros(b, d, A.size(-1), device=u.device, dtype=deltaA.dtype)
    ys = []
    for i in range(l):
        h = deltaA[:, i] * h + deltaB_u[:, i]
        ys.append((h * C[:, i].unsqueeze(1)).sum(-1))
    y = torch.stack(ys, dim=1)
    return y + u * D


class MambaMixer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d_inner = cfg.expand * cfg.d_model
        self.d_state = cfg.d_state
        self.dt_rank = cfg.dt_rank
        self.bc_norm = cfg.bc_norm
        self.in_proj = nn.Linear(cfg.d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, cfg.d_conv, groups=d_inner, padding=cfg.d_conv - 1)
        self.x_proj = nn.Linear(d_inner, cfg.dt_rank + 2 * cfg.d_state, bias=False)
        self.dt_proj = nn.Linear(cfg.dt_rank, d_inner)
        A = torch.arange(1, cfg.d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=False)
        self._init_dt(cfg)

    def _init_dt(self, cfg):
        log_span = math.log(cfg.dt_max) - math.log(cfg.dt_min)
        dt = torch.exp(torch.rand(self.dt_proj.out_features) * log_span + math.log(cfg.dt_min)).clamp(min=1e-4)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        with torch.no_grad():
            self.dt_proj.bias.copy_(inv_dt)

    def _normalize_bc(self, B, C):
        B = B * torch.rsqrt((B * B).mean(dim=-1, keepdim=True) + 1e-6)  # expect: AMP004
        C = C * torch.rsqrt(C.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        return B, C

    def _ssm(self, x):
        x_dbl = self.x_proj(x)
        r, n = self.dt_rank, self.d_state
        dt = x_dbl[..., :r]
        B = x_dbl[..., r:r + n]
        C = x_dbl[..., r + n:]
        if self.bc_norm:
            B, C = self._normalize_bc(B, C)
        delta = F.softplus(self.dt_proj(dt))
        A = -torch.exp(self.A_log.float())
        return selective_scan(x, delta, A, B, C, self.D)

    def forward(self, hidden):
        l = hidden.size(1)
        xz = self.in_proj(hidden)
        x, z = xz.chunk(2, dim=-1)
        x = self.conv1d(x.transpose(1, 2))[..., :l].transpose(1, 2)
        y = self._ssm(F.silu(x))
        return self.out_proj(y * F.silu(z))


class ResidualBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model)
        self.mixer = MambaMixer(cfg)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class MambaLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([ResidualBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def train(model, loader, args):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda")
    model.train()
    for step, (x, y) in enumerate(loader):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            logit_absmean = logits.detach().abs().mean()  # expect: AMP004
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)  # expect: AMP006
        if step % args.log_every == 0:
            ppl = math.exp(min(loss.item(), 20.0))
            print(f"step {step} loss {loss.item():.4f} ppl {ppl:.1f} |logit| {logit_absmean.item():.3f} gnorm {gnorm:.2f}")
        if step + 1 >= args.steps:
            break
    return model


def finetune_long_context(model, loader, lr=1e-5, steps=500):
    """Short continued pre-training at 4x the sequence length."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            logits = model(x.cuda())
            loss = F.cross_entropy(logits.flatten(0, 1), y.cuda().flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


@torch.no_grad()
def evaluate(model, loader, max_batches=50):
    model.eval()
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x.cuda())
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.cuda().flatten()).item())
    model.train()
    return sum(losses) / max(len(losses), 1)


@torch.no_grad()
def generate(model, prompt, max_new_tokens=64, temperature=0.8, top_k=50):
    model.eval()
    ids = prompt.cuda()
    for _ in range(max_new_tokens):
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(ids)[:, -1] / temperature
        v, _ = torch.topk(logits, top_k)
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
        ids = torch.cat([ids, torch.multinomial(F.softmax(logits.float(), dim=-1), 1)], dim=1)
    return ids


def random_token_loader(vocab, seq_len, batch_size, n_batches):
    for _ in range(n_batches):
        seq = torch.randint(0, vocab, (batch_size, seq_len + 1))
        yield seq[:, :-1], seq[:, 1:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=512)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8)
    p.add_argument("--log-every", dest="log_every", type=int, default=20)
    args = p.parse_args()

    cfg = SSMConfig()
    model = MambaLM(cfg).cuda()
    train(model, random_token_loader(cfg.vocab_size, args.seq_len, args.batch_size, args.steps), args)
    print("val loss", evaluate(model, random_token_loader(cfg.vocab_size, args.seq_len, 4, 50)))
    long_loader = random_token_loader(cfg.vocab_size, 4 * args.seq_len, 2, 500)
    finetune_long_context(model, long_loader)
    print(generate(model, torch.randint(0, cfg.vocab_size, (1, 8)))[0].tolist())


if __name__ == "__main__":
    main()
