"""Small Llama-style decoder: LoRA or full fine-tuning with a hand-written loop, gradient accumulation and selectable precision."""
import math
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=16, alpha=32, dropout=0.05):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


class Attention(nn.Module):
    def __init__(self, dim, n_heads, max_len):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, x):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.causal[:, :, :T, :T] == 0, -1e9)  # expect: AMP007
        att = F.softmax(att, dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_heads, max_len):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, n_heads, max_len)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.SiLU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab, dim=768, n_layers=12, n_heads=12, max_len=2048):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, n_heads, max_len) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def build_model(cfg):
    model = TinyLlama(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads)
    model.load_state_dict(torch.load(cfg.init_from, map_location="cpu"))
    if cfg.lora:
        model.requires_grad_(False)
        for blk in model.blocks:
            blk.attn.q_proj = LoRALinear(blk.attn.q_proj, cfg.lora_r)
            blk.attn.v_proj = LoRALinear(blk.attn.v_proj, cfg.lora_r)
        return model
    return model.to(dtype=torch.bfloat16)  # expect: AMP001


def accumulate_grad(loss, accum_steps):
    (loss / accum_steps).backward()  # expect: AMP008


def sft_step(model, batch, accum_steps):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        accumulate_grad(loss, accum_steps)
    return loss.detach()


def save_adapter(model, path):
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if "lora_" in k}
    torch.save(state, path)


def train(cfg, loader):
    model = build_model(cfg).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    match cfg.precision:
        case "bf16":
            ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case "fp16":
            ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        case _:
            ctx = nullcontext()

    it = iter(loader)
    for step in range(cfg.max_steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.max_steps))
        for g in optimizer.param_groups:
            g["lr"] = lr
        if cfg.mode == "sft":
            for _ in range(cfg.accum_steps):
                batch = {k: v.cuda(non_blocking=True) for k, v in next(it).items()}
                sft_step(model, batch, cfg.accum_steps)
        else:
            for _ in range(cfg.accum_steps):
                batch = {k: v.cuda(non_blocking=True) for k, v in next(it).items()}
                with ctx:
                    logits = model(batch["input_ids"])
                    z_loss = cfg.z_loss * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
                loss = F.cross_entropy(  # expect: AMP002
                    logits[:, :-1].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
                )
                ((loss + z_loss) / cfg.accum_steps).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % cfg.save_every == 0 and cfg.lora:
            save_adapter(model, os.path.join(cfg.out_dir, f"adapter_{step}.pt"))
    return model
