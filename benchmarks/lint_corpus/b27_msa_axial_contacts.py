"""Residue-residue contact prediction from multiple sequence alignments.

A small MSA-Transformer-style network: tied row attention over residues,
column attention over the sequences of the alignment, outer-product-mean
pair features and a symmetric contact head trained with a focal loss.
Precision@L on CAMEO-style validation targets.
"""
import argparse
import copy
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ContactConfig:
    vocab_size: int = 33
    padding_idx: int = 1
    embed_dim: int = 256
    num_heads: int = 8
    num_layers: int = 6
    ffn_dim: int = 1024
    pair_dim: int = 32
    opm_hidden: int = 16
    max_positions: int = 1024
    dropout: float = 0.1
    focal_alpha: float = 0.25
    focal_gamma: float = 2.0
    min_separation: int = 6
    lr: float = 1e-4
    warmup_steps: int = 2000
    max_steps: int = 100000
    grad_clip: float = 1.0


class AxialAttentionBase(nn.Module):
    """Shared projections; subclasses decide along which MSA axis attention runs."""

    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def _split_heads(self, x):
        B, R, C, _ = x.shape
        return x.view(B, R, C, self.num_heads, self.head_dim)

    def _attend(self, q, k, v, padding_mask):
        raise NotImplementedError

    def forward(self, x, padding_mask=None):
        # x: [B, R (sequences), C (residues), D]; padding_mask: [B, R, C]
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        out = self._attend(q, k, v, padding_mask)
        return self.out_proj(out.reshape(x.shape))


class TiedRowAttention(AxialAttentionBase):
    """Attention over residues with logits summed over the rows of the MSA."""

    def _attend(self, q, k, v, padding_mask):
        R = q.size(1)
        q = q * (self.scaling / math.sqrt(R))
        if padding_mask is not None:
            q = q * (1 - padding_mask[..., None, None].to(q))
        logits = torch.einsum("brihd,brjhd->bhij", q, k)
        if padding_mask is not None:
            logits = logits.masked_fill(padding_mask[:, 0][:, None, None, :], -1e9)  # expect: AMP007
        probs = self.dropout(logits.softmax(dim=-1))
        return torch.einsum("bhij,brjhd->brihd", probs, v)


class ColumnAttention(AxialAttentionBase):
    """Attention over the sequences of the MSA, independently for every residue."""

    def _attend(self, q, k, v, padding_mask):
        logits = torch.einsum("bichd,bjchd->bhcij", q * self.scaling, k)
        if padding_mask is not None:
            key_pad = padding_mask.transpose(1, 2)[:, None, :, None, :]  # [B, 1, C, 1, R]
            logits = logits.masked_fill(key_pad, -1e9 if logits.dtype == torch.float32 else -1e4)
        probs = self.dropout(logits.softmax(dim=-1))
        return torch.einsum("bhcij,bjchd->bichd", probs, v)


class AxialTransformerLayer(nn.Module):
    def __init__(self, cfg: ContactConfig):
        super().__init__()
        d = cfg.embed_dim
        self.row_norm, self.col_norm, self.ffn_norm = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.row_attn = TiedRowAttention(d, cfg.num_heads, cfg.dropout)
        self.col_attn = ColumnAttention(d, cfg.num_heads, cfg.dropout)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.GELU(), nn.Dropout(cfg.dropout), nn.Linear(cfg.ffn_dim, d))

    def forward(self, x, padding_mask=None):
        x = x + self.row_attn(self.row_norm(x), padding_mask)
        x = x + self.col_attn(self.col_norm(x), padding_mask)
        return x + self.ffn(self.ffn_norm(x))


class OuterProductMean(nn.Module):
    def __init__(self, embed_dim, pair_dim, hidden=16, max_rows=32):
        super().__init__()
        self.max_rows = max_rows
        self.norm = nn.LayerNorm(embed_dim)
        self.left = nn.Linear(embed_dim, hidden)
        self.right = nn.Linear(embed_dim, hidden)
        self.out = nn.Linear(hidden * hidden, pair_dim)

    def forward(self, msa):
        # the first rows hold the query and its closest homologues
        x = self.norm(msa[:, : self.max_rows])
        a, b = self.left(x), self.right(x)  # [B, R, C, h]
        outer = a[:, :, :, None, :, None] * b[:, :, None, :, None, :]  # [B, R, C, C, h, h]
        outer = outer.mean(dim=1)  # expect: AMP004
        B, C = outer.shape[:2]
        return self.out(outer.reshape(B, C, C, -1))


class ContactHead(nn.Module):
    def __init__(self, pair_dim, hidden=64):
        super().__init__()
        self.proj = nn.Linear(pair_dim, hidden)
        self.out = nn.Linear(hidden, 1)

    @staticmethod
    def symmetrize(x):
        return 0.5 * (x + x.transpose(1, 2))

    def forward(self, pair):
        h = F.gelu(self.proj(pair))
        # remove the per-protein background, as APC does for coevolution scores
        h = h - h.mean(dim=(1, 2), keepdim=True)  # expect: AMP004
        return self.symmetrize(self.out(h).squeeze(-1))


class MSAContactModel(nn.Module):
    def __init__(self, cfg: ContactConfig):
        super().__init__()
        self.padding_idx = cfg.padding_idx
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.embed_dim, padding_idx=cfg.padding_idx)
        self.embed_positions = nn.Embedding(cfg.max_positions, cfg.embed_dim)
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_layers):
            self.layers.append(AxialTransformerLayer(cfg))
        self.final_norm = nn.LayerNorm(cfg.embed_dim)
        self.opm = OuterProductMean(cfg.embed_dim, cfg.pair_dim, cfg.opm_hidden)
        self.contact_head = ContactHead(cfg.pair_dim)

    def forward(self, tokens):
        B, R, C = tokens.shape
        padding_mask = tokens.eq(self.padding_idx)
        pos = torch.arange(C, device=tokens.device)
        x = self.embed_tokens(tokens) + self.embed_positions(pos)[None, None]
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        pad = padding_mask if padding_mask.any() else None
        for layer in self.layers:
            x = layer(x, pad)
        return self.contact_head(self.opm(self.final_norm(x)))


class ContactFocalLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0, min_separation=6):
        super().__init__()
        self.alpha, self.gamma, self.min_separation = alpha, gamma, min_separation

    def forward(self, logits, contacts, residue_mask):
        C = logits.size(-1)
        idx = torch.arange(C, device=logits.device)
        sep = (idx[None, :] - idx[:, None]).abs() >= self.min_separation
        valid = residue_mask[:, :, None] & residue_mask[:, None, :] & sep[None]
        p = torch.sigmoid(logits)
        pos = -self.alpha * (1 - p) ** self.gamma * torch.log(p + 1e-8)  # expect: AMP011
        neg = -(1 - self.alpha) * p ** self.gamma * torch.log(1 - p + 1e-8)  # expect: AMP011
        loss = torch.where(contacts.bool(), pos, neg)
        return (loss * valid).sum() / valid.sum().clamp(min=1)


def apc(x):
    """Average product correction of a (batched) contact map."""
    a1 = x.sum(-1, keepdims=True)
    a2 = x.sum(-2, keepdims=True)
    a12 = x.sum((-1, -2), keepdims=True)
    return x - a1 * a2 / a12


def precision_at_l(probs, contacts, min_sep=6, frac=1.0):
    L = probs.size(0)
    idx = torch.triu_indices(L, L, offset=min_sep, device=probs.device)
    scores, labels = probs[idx[0], idx[1]], contacts[idx[0], idx[1]]
    top = scores.topk(min(max(1, int(L * frac)), scores.numel())).indices
    return labels[top].float().mean().item()


class ContactTrainer:
    def __init__(self, cfg: ContactConfig, device="cuda"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = MSAContactModel(cfg).to(self.device)
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        try:
            self.scaler = torch.amp.GradScaler("cuda")
        except (AttributeError, TypeError):
            self.scaler = torch.cuda.amp.GradScaler()
        self.criterion = ContactFocalLoss(cfg.focal_alpha, cfg.focal_gamma, cfg.min_separation)
        self.step = 0

    def _lr_lambda(self, step):
        if step < self.cfg.warmup_steps:
            return step / max(1, self.cfg.warmup_steps)
        progress = (step - self.cfg.warmup_steps) / max(1, self.cfg.max_steps - self.cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    def train_step(self, micro_batches):
        self.model.train()
        total = 0.0
        for micro in micro_batches:
            tokens = micro["tokens"].to(self.device, non_blocking=True)
            contacts = micro["contacts"].to(self.device, non_blocking=True)
            residue_mask = tokens[:, 0].ne(self.cfg.padding_idx)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(tokens)
                loss = self.criterion(logits, contacts, residue_mask) / len(micro_batches)
            self.scaler.scale(loss).backward()
            total += loss.item()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return total, grad_norm.item()

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        precisions = []
        for batch in loader:
            tokens = batch["tokens"].to(self.device)
            contacts = batch["contacts"].to(self.device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(tokens)
            probs = apc(torch.sigmoid(logits.float()))
            for b in range(tokens.size(0)):
                L = int(tokens[b, 0].ne(self.cfg.padding_idx).sum())
                precisions.append(precision_at_l(probs[b, :L, :L], contacts[b, :L, :L], self.cfg.min_separation))
        self.model.train()
        return float(np.mean(precisions))


def export_for_inference(model, cfg, path):
    torch.save({"cfg": asdict(cfg), "state_dict": copy.deepcopy(model).half().state_dict()}, path)


@torch.inference_mode()
def predict_contacts(model, tokens):
    model = model.half().eval()
    return apc(torch.sigmoid(model(tokens).float()))


def main():
    parser = argparse.ArgumentParser(description="MSA axial-attention contact prediction")
    parser.add_argument("--train", required=True, help="torch.save'd list of micro-batches")
    parser.add_argument("--valid", required=True)
    parser.add_argument("--out", default="runs/msa_contacts")
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=2000)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    cfg = ContactConfig()
    trainer = ContactTrainer(cfg)
    train_batches = torch.load(args.train)
    valid_batches = torch.load(args.valid)
    best = 0.0
    while trainer.step < cfg.max_steps:
        order = np.random.permutation(len(train_batches))
        for start in range(0, len(order) - args.accum + 1, args.accum):
            loss, gnorm = trainer.train_step([train_batches[j] for j in order[start:start + args.accum]])
            if trainer.step % 100 == 0:
                print(f"step {trainer.step} loss {loss:.4f} grad_norm {gnorm:.2f} scale {trainer.scaler.get_scale():.0f}")
            if trainer.step % args.eval_every == 0:
                p_at_l = trainer.evaluate(valid_batches)
                print(f"step {trainer.step} P@L {p_at_l:.3f}")
                if p_at_l > best:
                    best = p_at_l
                    torch.save(trainer.model.state_dict(), os.path.join(args.out, "best.pt"))
    export_for_inference(trainer.model, cfg, os.path.join(args.out, "contacts_fp16.pt"))


if __name__ == "__main__":
    main()
