"""Mixture-of-experts layer with a top-k router, load-balancing loss and router z-loss."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Router(nn.Module):
    def __init__(self, dim, n_experts, k=2, jitter=0.01):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.k = k
        self.jitter = jitter

    def forward(self, x):
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1 - self.jitter, 1 + self.jitter)
        logits = self.gate(x).float()
        probs = logits.softmax(dim=-1)
        topk_probs, topk_idx = probs.topk(self.k, dim=-1)
        topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        density = F.one_hot(topk_idx[..., 0], probs.size(-1)).float().mean(0)
        balance = (density * probs.mean(0)).sum() * probs.size(-1)
        return topk_probs, topk_idx, balance, z_loss


class MoE(nn.Module):
    def __init__(self, dim, hidden, n_experts=8, k=2):
        super().__init__()
        self.router = Router(dim, n_experts, k)
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs, idx, balance, z_loss = self.router(flat)
        out = torch.zeros_like(flat)
        for slot in range(idx.size(-1)):
            for e in range(self.w1.size(0)):
                sel = idx[:, slot] == e
                if sel.any():
                    h = F.gelu(flat[sel] @ self.w1[e]) @ self.w2[e]
                    out[sel] += probs[sel, slot, None].to(h.dtype) * h
        return out.view(B, T, C), balance, z_loss


def train_step(model, batch, optimizer, scaler, aux_weight=0.01, z_weight=0.001):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, balance, z_loss = model(batch["input_ids"])
        lm_loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss = lm_loss + aux_weight * balance + z_weight * z_loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return lm_loss.detach()


def capacity_mask(scores, capacity):
    ranks = scores.argsort(dim=0, descending=True).argsort(dim=0)
    return scores.masked_fill(ranks >= capacity, -1e4)
