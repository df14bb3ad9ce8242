"""Dense graph transformer for molecular property prediction (Tox21-style multi-task).

Nodes attend to all nodes of their molecule with an edge-feature bias; Laplacian
eigenvectors (random sign flips during training) give positional encodings.
Trained under bf16 autocast on an A100, so there is no loss scaler.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ATOM_VOCAB = [119, 5, 12, 12, 10, 6, 6, 2, 2]   # RDKit-style categorical atom features
BOND_DIM = 14


def laplacian_pe(adj, k):
    """Symmetric normalised Laplacian eigenvectors for one molecule (numpy, preprocessing)."""
    deg = adj.sum(1)
    d_inv_sqrt = 1.0 / np.sqrt(deg + 1e-12)
    lap = np.eye(adj.shape[0]) - d_inv_sqrt[:, None] * adj * d_inv_sqrt[None, :]
    eigval, eigvec = np.linalg.eigh(lap)
    eigvec = eigvec[:, 1:k + 1]
    if eigvec.shape[1] < k:
        eigvec = np.pad(eigvec, ((0, 0), (0, k - eigvec.shape[1])))
    eigvec = eigvec / (np.linalg.norm(eigvec, axis=0, keepdims=True) + 1e-12)
    return eigvec.astype(np.float32), eigval[1:k + 1].astype(np.float32)


class AtomEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(v + 1, dim) for v in ATOM_VOCAB])

    def forward(self, x):
        return sum(emb(x[..., i]) for i, emb in enumerate(self.embs))


class LapPE(nn.Module):
    def __init__(self, k, dim):
        super().__init__()
        self.lin = nn.Linear(k, dim)

    def forward(self, eigvec):
        pe = self.lin(eigvec)
        pe = (pe - pe.mean(1, keepdim=True)) / (pe.std(1, keepdim=True) + 1e-8)  # expect: AMP004
        return pe


class EdgeBias(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.enc = nn.Linear(BOND_DIM, heads)

    def forward(self, edge_attr):
        bias = self.enc(edge_attr)
        bias = bias - bias.mean(dim=(1, 2), keepdim=True)  # expect: AMP004
        return bias.permute(0, 3, 1, 2)


class GraphNorm(nn.Module):
    """GraphNorm (Cai et al.) with padding-aware per-graph statistics."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.alpha = nn.Parameter(torch.ones(dim))

    def forward(self, h, node_mask):
        m = node_mask.unsqueeze(-1).to(h.dtype)
        n = m.sum(1, keepdim=True).clamp(min=1)
        mean = (h * m).sum(1, keepdim=True) / n
        centered = (h - self.alpha * mean) * m
        var = centered.pow(2).sum(1, keepdim=True) / n
        return self.weight * centered / torch.sqrt(var + 1e-8) + self.bias


class BiasedAttention(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads, self.dh = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, h, bias, node_mask):
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.dh) + bias
        scores = scores.masked_fill(~node_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = self.drop(scores.softmax(-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, d))


class GTLayer(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = BiasedAttention(dim, heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * dim, dim))
        self.gnorm = GraphNorm(dim)

    def forward(self, h, bias, node_mask):
        h = h + self.attn(self.norm1(h), bias, node_mask)
        h = h + self.gnorm(self.ffn(h), node_mask)
        return h


class MolGraphTransformer(nn.Module):
    def __init__(self, dim=256, heads=8, layers=8, k_pe=16, n_tasks=12):
        super().__init__()
        self.atom = AtomEncoder(dim)
        self.pe = LapPE(k_pe, dim)
        self.edge = EdgeBias(heads)
        self.layers = nn.ModuleList([GTLayer(dim, heads) for _ in range(layers)])
        self.vn_embed = nn.Parameter(torch.zeros(1, dim))
        self.vn_msg = nn.Linear(dim, dim)
        self.vn_mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.readout_proj = nn.Linear(dim, dim)
        self.head = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, n_tasks))

    def forward(self, batch):
        node_mask = batch["node_mask"]
        h = self.atom(batch["x"]) + self.pe(batch["eigvec"])
        bias = self.edge(batch["edge_attr"])
        vn = self.vn_embed.expand(h.shape[0], -1)
        for layer in self.layers:
            h = layer(h + vn.unsqueeze(1), bias, node_mask)
            vn = vn + self.vn_mlp(self.vn_msg(h).mean(1))  # expect: AMP004
        hg = self.readout_proj(h).masked_fill(~node_mask[..., None], 0.0)
        n_nodes = node_mask.sum(1, keepdim=True).clamp(min=1)
        mean_pool = hg.mean(1) * (hg.shape[1] / n_nodes)  # expect: AMP004
        max_pool = hg.masked_fill(~node_mask[..., None], -1e4).amax(1)
        return self.head(torch.cat([mean_pool, max_pool], dim=-1))


def flip_signs(eigvec):
    sign = torch.randint(0, 2, (eigvec.shape[0], 1, eigvec.shape[-1]), device=eigvec.device) * 2 - 1
    return eigvec * sign


@torch.no_grad()
def evaluate(model, loader, device):
    from sklearn.metrics import roc_auc_score

    model.eval()
    ys, ps = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch)
        ps.append(torch.sigmoid(logits.float()).cpu().numpy())
        ys.append(batch["y"].cpu().numpy())
    y, p = np.concatenate(ys), np.concatenate(ps)
    aucs = [roc_auc_score(y[~np.isnan(y[:, t]), t], p[~np.isnan(y[:, t]), t]) for t in range(y.shape[1])]
    model.train()
    return float(np.mean(aucs))


def train(rank, world_size, train_loader, val_loader, epochs=100):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model = MolGraphTransformer().to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.01, eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    criterion = nn.BCELoss(reduction="none")
    for epoch in range(epochs):
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            batch["eigvec"] = flip_signs(batch["eigvec"])
            y = batch["y"]
            label_mask = ~torch.isnan(y)
            with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
                logits = model(batch)
                per_task = criterion(torch.sigmoid(logits), torch.nan_to_num(y))  # expect: AMP003
                loss = (per_task * label_mask).sum() / label_mask.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
        sched.step()
        if rank == 0:
            auc = evaluate(model.module, val_loader, device)
            print(f"epoch {epoch}: loss {loss.item():.4f} val ROC-AUC {auc:.4f}")
            torch.save(model.module.state_dict(), f"gt_mol_{epoch:03d}.pt")
