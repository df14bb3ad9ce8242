"""Longformer-style causal language model: sliding-window attention plus a few
global "sink" tokens, gated MLP, per-head QK normalisation, document head.

Trained with CUDA fp16 autocast and a GradScaler.
"""
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LongformerConfig:
    vocab_size: int = 32000
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    window: int = 128
    n_global: int = 16
    max_len: int = 4096
    n_doc_classes: int = 20
    dropout: float = 0.1


ctx = torch.autocast(device_type="cuda", dtype=torch.float16)


class ScaleNorm(nn.Module):
    """One learned gain over the L2 norm of the residual stream."""

    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(math.sqrt(d_model)))
        self.eps = eps

    def forward(self, x):
        n = torch.norm(x, dim=-1, keepdim=True).clamp(min=self.eps)
        return x * (self.g / n)


class HeadRMSNorm(nn.Module):
    """RMS norm over the head dimension, applied to queries and keys."""

    def __init__(self, head_dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x):
        ms = (x * x).mean(dim=-1, keepdim=True)  # expect: AMP004
        return x * torch.rsqrt(ms + self.eps) * self.weight


class SlidingWindowAttention(nn.Module):
    def __init__(self, cfg: LongformerConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.window = cfg.window
        self.n_global = cfg.n_global
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.k_global = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_global = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.q_norm = HeadRMSNorm(self.head_dim)
        self.k_norm = HeadRMSNorm(self.head_dim)
        self.attn_drop = nn.Dropout(cfg.dropout)

    def _split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

    def _band(self, T, device):
        i = torch.arange(T, device=device)
        rel = i[None, :] - i[:, None]
        return (rel <= 0) & (rel > -self.window)

    def forward(self, x, key_padding, global_tokens):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q = self.q_norm(self._split(q))
        k = self.k_norm(self._split(k))
        v = self._split(v)

        local = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        allowed = self._band(T, x.device)[None, None] & ~key_padding[:, None, None, :]
        local = local.masked_fill(~allowed, -1e9)  # expect: AMP007

        # global tokens: every position may attend to them; a batch with fewer
        # than n_global of them is padded up to a fixed number of slots
        n_g = global_tokens.size(1)
        kg = self._split(self.k_global(global_tokens))
        vg = self._split(self.v_global(global_tokens))
        glob = (q @ kg.transpose(-2, -1)) / math.sqrt(self.head_dim)
        glob = F.pad(glob, (0, self.n_global - n_g), value=-1e9)  # expect: AMP007
        vg = F.pad(vg, (0, 0, 0, self.n_global - n_g))

        scores = torch.cat([glob, local], dim=-1)
        probs = self.attn_drop(F.softmax(scores, dim=-1))
        y = probs[..., : self.n_global] @ vg + probs[..., self.n_global:] @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.out(y)


class GatedMLP(nn.Module):
    def __init__(self, d_model, mult=4, dropout=0.1):
        super().__init__()
        hidden = int(mult * d_model * 2 / 3)
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)
        self.drop = nn.Dropout(dropout)
        self.act_var = None

    def forward(self, x):
        a, b = self.w_in(x).chunk(2, dim=-1)
        h = F.silu(a) * b
        # per-token spread of the hidden activations, used as a regulariser
        self.act_var = h.var(dim=-1).mean()  # expect: AMP004
        return self.w_out(self.drop(h))


class LongformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SlidingWindowAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = GatedMLP(cfg.d_model, dropout=cfg.dropout)

    def forward(self, x, key_padding, global_tokens):
        x = x + self.attn(self.ln1(x), key_padding, global_tokens)
        x = x + self.mlp(self.ln2(x))
        return x


class DocumentHead(nn.Module):
    """Gated mean pooling over the sequence for document classification."""

    def __init__(self, d_model, n_classes):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)
        self.gate = nn.Linear(d_model, 1)
        self.cls = nn.Linear(2 * d_model, n_classes)

    def forward(self, h, key_padding):
        keep = (~key_padding).unsqueeze(-1)
        proj = self.proj(h)
        gate = F.relu(self.gate(h))
        gate = gate / (gate.amax(dim=1, keepdim=True) + 1e-8)  # expect: AMP011
        weighted = (torch.tanh(proj) * gate * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)
        pooled = proj.mean(dim=1)  # expect: AMP004
        return self.cls(torch.cat([weighted, pooled], dim=-1))


class LongformerLM(nn.Module):
    def __init__(self, cfg: LongformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.glob = nn.Parameter(torch.randn(cfg.n_global, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList([LongformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = ScaleNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.doc_head = DocumentHead(cfg.d_model, cfg.n_doc_classes)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx, key_padding):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)[None]
        g = self.glob[None].expand(B, -1, -1)
        for blk in self.blocks:
            x = blk(x, key_padding, g)
        h = self.ln_f(x)
        logits = self.lm_head(h)
        doc_logits = self.doc_head(h, key_padding)
        act_reg = sum(blk.mlp.act_var for blk in self.blocks) / len(self.blocks)
        return logits, doc_logits, act_reg


def lm_loss(logits, targets, key_padding, z_weight=1e-4):
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    ce = ce.masked_fill(key_padding.flatten(), 0.0)
    z = torch.logsumexp(logits, dim=-1)
    z_loss = (z ** 2).mean()
    return ce.sum() / (~key_padding).sum().clamp(min=1) + z_weight * z_loss


def train(cfg, loader, epochs=1, lr=3e-4, accum=4, device="cuda"):
    model = LongformerLM(cfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-6,
    )
    scaler = torch.amp.GradScaler("cuda")
    best_val_loss = 1e9
    step = 0
    for epoch in range(epochs):
        model.train()
        for it, batch in enumerate(loader):
            idx = batch["input_ids"].to(device, non_blocking=True)
            tgt = batch["labels"].to(device, non_blocking=True)
            pad = batch["padding_mask"].to(device, non_blocking=True)
            doc_y = batch["doc_label"].to(device, non_blocking=True)
            with ctx:
                logits, doc_logits, act_reg = model(idx, pad)
                loss = lm_loss(logits, tgt, pad)
                loss = loss + 0.1 * F.cross_entropy(doc_logits, doc_y) + 1e-3 * act_reg
                scaler.scale(loss / accum).backward()  # expect: AMP008
            if (it + 1) % accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
        val = evaluate(model, loader, device)
        if val < best_val_loss:
            best_val_loss = val
            torch.save(model.state_dict(), "longformer_best.pt")
    return model


@torch.no_grad()
def evaluate(model, loader, device, max_batches=50):
    model.eval()
    total, n = 0.0, 0
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        idx = batch["input_ids"].to(device)
        pad = batch["padding_mask"].to(device)
        with ctx:
            logits, _, _ = model(idx, pad)
        total += lm_loss(logits.float(), batch["labels"].to(device), pad).item()
        n += 1
    model.train()
    return total / max(n, 1)


def export_for_serving(model, path):
    served = copy.deepcopy(model).half().eval()
    torch.save(served.state_dict(), path)
