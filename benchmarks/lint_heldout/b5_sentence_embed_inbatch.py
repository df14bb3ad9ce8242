"""Contrastive sentence-embedding training with in-batch negatives (fp16 + GradScaler) and a hard-negative finetune stage."""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim, heads=8):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, -1e9)  # expect: AMP007
        out = scores.softmax(dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        x = x + self.attn(self.n1(x), mask)
        return x + self.ff(self.n2(x))


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=50000, dim=384, depth=6, out_dim=256, max_len=256):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.layers = nn.ModuleList([Layer(dim) for _ in range(depth)])
        self.proj = nn.Linear(dim, out_dim)

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos[:, : ids.size(1)]
        for layer in self.layers:
            x = layer(x, mask)
        return self.proj(x)


def masked_mean(tok, mask):
    m = mask.unsqueeze(-1).to(tok.dtype)
    return (tok * m).sum(1) / m.sum(1).clamp(min=1.0)


def train_inbatch(model: SentenceEncoder, loader, optimizer, scaler, temperature=0.05, margin_w=0.1):
    model.train()
    model.tok.half()  # expect: AMP001
    for q_ids, q_mask, d_ids, d_mask in loader:
        q_ids, q_mask, d_ids, d_mask = (t.cuda(non_blocking=True) for t in (q_ids, q_mask, d_ids, d_mask))
        with torch.autocast("cuda", dtype=torch.float16):
            q_tok = model(q_ids, q_mask)
            d_tok = model(d_ids, d_mask)
            q = masked_mean(q_tok, q_mask)
            d = d_tok.mean(dim=1)  # expect: AMP004
            q = F.normalize(q, dim=-1)
            d = F.normalize(d, dim=-1)
            sim = q @ d.T / temperature
            eye = torch.eye(sim.size(0), dtype=torch.bool, device=sim.device)
            pos = sim.diagonal()
            hardest = sim.masked_fill(eye, float("-inf")).amax(dim=1)
            rel_gap = (pos - hardest) / (pos.abs() + hardest.abs() + 1e-8)  # expect: AMP011
            margin = -torch.log(torch.sigmoid(pos - hardest) + 1e-8).sum() / pos.numel()  # expect: AMP011
        labels = torch.arange(sim.size(0), device=sim.device)
        loss = F.cross_entropy(sim, labels) + margin_w * (margin - rel_gap.float().sum() / pos.numel())  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


def finetune_hard_negatives(model: SentenceEncoder, loader, optimizer, margin=0.2):
    model.train()
    for q_ids, q_mask, p_ids, p_mask, n_ids, n_mask in loader:
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            q = F.normalize(masked_mean(model(q_ids.cuda(), q_mask.cuda()), q_mask.cuda()), dim=-1)
            p = F.normalize(masked_mean(model(p_ids.cuda(), p_mask.cuda()), p_mask.cuda()), dim=-1)
            n = F.normalize(masked_mean(model(n_ids.cuda(), n_mask.cuda()), n_mask.cuda()), dim=-1)
            loss = F.triplet_margin_loss(q, p, n, margin=margin)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def encode_corpus(model, batches):
    with torch.inference_mode():
        enc = copy.deepcopy(model).half().eval()
        out = []
        for ids, mask in batches:
            emb = masked_mean(enc(ids.cuda(), mask.cuda()), mask.cuda())
            out.append(F.normalize(emb.float(), dim=-1).cpu())
    return torch.cat(out)


def main(pair_loader, triplet_loader, epochs=3):
    model = SentenceEncoder().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01, eps=1e-6)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        train_inbatch(model, pair_loader, optimizer, scaler)
    finetune_hard_negatives(model, triplet_loader, optimizer)
    torch.save(model.state_dict(), "sbert.pt")
