"""Decoder-only MoE transformer (top-2 routing, Switch load-balancing loss,
router z-loss, QK-LayerNorm as in OLMoE), with pretraining and SFT loops."""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoEConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 1536
    aux_coef: float = 1e-2
    z_coef: float = 1e-3


class QKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)  # expect: AMP004
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + 1e-8) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.q_norm = QKNorm(cfg.d_model)
        self.k_norm = QKNorm(cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, t, self.n_head, -1).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(b, t, self.n_head, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class Expert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.n_experts = cfg.top_k, cfg.n_experts
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(cfg) for _ in range(cfg.n_experts)])
        self.register_buffer("logit_std", torch.zeros(()), persistent=False)
        self.register_buffer("logit_mean", torch.zeros(cfg.n_experts), persistent=False)

    def _track_router(self, router_logits):
        with torch.no_grad():
            self.logit_std.copy_(router_logits.std(dim=-1).float().mean())  # expect: AMP004
            self.logit_mean.mul_(0.99).add_(router_logits.mean(dim=0), alpha=0.01)  # expect: AMP004

    def forward(self, x):
        b, t, c = x.shape
        x_flat = x.view(-1, c)
        router_logits = self.gate(x_flat)
        self._track_router(router_logits)
        probs = F.softmax(router_logits, dim=-1)
        topk_p, topk_idx = probs.topk(self.top_k, dim=-1)
        topk_p = topk_p / (topk_p.sum(dim=-1, keepdim=True) + 1e-9)
        # Switch-Transformer load balancing: fraction routed x mean router probability
        density = F.one_hot(topk_idx, self.n_experts).sum(dim=1).float().mean(dim=0)
        density_proxy = probs.mean(dim=0)
        aux = (density * density_proxy).sum() * self.n_experts / self.top_k
        z_loss = torch.logsumexp(router_logits, dim=-1).pow(2).mean()
        out = torch.zeros_like(x_flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(topk_idx == e)
            if token_idx.numel() == 0:
                continue
            y = expert(x_flat[token_idx]) * topk_p[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out.view(b, t, c), aux, z_loss


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.moe = SparseMoE(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h, aux, z = self.moe(self.ln_2(x))
        return x + h, aux, z


class MoEGPT(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        aux_total, z_total = 0.0, 0.0
        for block in self.blocks:
            x, aux, z = block(x)
            aux_total = aux_total + aux
            z_total = z_total + z
        logits = self.lm_head(self.ln_f(x))
        return logits, self.cfg.aux_coef * aux_total + self.cfg.z_coef * z_total


@torch.no_grad()
def estimate_loss(model, batches):
    model.eval()
    losses = torch.zeros(len(batches))
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _ = model(x)
            losses[i] = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item()
    model.train()
    return losses.mean().item()


def pretrain(model, loader, val_batches, args):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda")
    for it, (x, y) in enumerate(loader):
        lr = args.lr * min(1.0, (it + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(it / args.max_iters, 1.0)))
        for g in optimizer.param_groups:
            g["lr"] = lr
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, aux_loss = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) + aux_loss  # expect: AMP002
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if it % args.eval_interval == 0:
            print(f"it {it}: loss {loss.item():.4f} val {estimate_loss(model, val_batches):.4f}")
        if it >= args.max_iters:
            break


def finetune_sft(model, loader, args):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda")
    for step, (x, y, loss_mask) in enumerate(loader):
        x, y, loss_mask = x.cuda(), y.cuda(), loss_mask.cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            logits, aux_loss = model(x)
            ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="none")
            loss = (ce * loss_mask.view(-1)).sum() / loss_mask.sum().clamp(min=1) + aux_loss
            scaler.scale(loss).backward()  # expect: AMP008
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"sft step {step}: loss {loss.item():.4f}")


def main(args, pretrain_loader, sft_loader, val_batches):
    torch.manual_seed(1337)
    model = MoEGPT(MoEConfig(n_experts=args.n_experts, top_k=args.top_k)).cuda()
    pretrain(model, pretrain_loader, val_batches, args)
    finetune_sft(model, sft_loader, args)
    torch.save(model.state_dict(), args.out)
