"""Graphormer-style graph transformer for molecular property regression.

Predicts the HOMO-LUMO gap (PCQM4Mv2) with an auxiliary bond-existence objective,
and supports masked-atom pretraining. Graphs arrive densely padded from the collator:
  atoms [B, N, F_atom] (float features), node_mask [B, N], spatial_pos [B, N, N],
  in_degree / out_degree [B, N], adjacency [B, N, N], y [B].
"""
import argparse
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from molecule_data import PCQM4Mv2Dense, dense_collate  # local module


@dataclass
class Config:
    atom_features: int = 64
    num_atom_types: int = 128
    hidden: int = 512
    heads: int = 16
    layers: int = 12
    max_degree: int = 64
    max_spatial: int = 32
    dropout: float = 0.1
    attn_dropout: float = 0.1
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10000
    total_steps: int = 1000000
    batch_size: int = 256
    clip: float = 5.0
    bond_weight: float = 0.2
    amp: bool = True
    data_root: str = "data/pcqm4m-v2"
    out_dir: str = "runs/graphormer"


class CentralityEncoding(nn.Module):
    def __init__(self, max_degree, hidden):
        super().__init__()
        self.in_deg = nn.Embedding(max_degree + 1, hidden, padding_idx=0)
        self.out_deg = nn.Embedding(max_degree + 1, hidden, padding_idx=0)

    def forward(self, in_degree, out_degree):
        return self.in_deg(in_degree) + self.out_deg(out_degree)


class GraphAttention(nn.Module):
    def __init__(self, hidden, heads, attn_dropout):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(attn_dropout)

    def forward(self, x, attn_bias, node_mask):
        B, N, _ = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) * self.scale + attn_bias
        scores = scores.masked_fill(~node_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = self.dropout(scores.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(B, N, -1)
        return self.out_proj(out)


class GraphNorm(nn.Module):
    """GraphNorm (Cai et al. 2021): normalise node features per graph with a learnable shift."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.mean_scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)  # expect: AMP004
        centered = x - mean * self.mean_scale
        var = centered.float().pow(2).mean(dim=1, keepdim=True)
        return self.weight * centered * torch.rsqrt(var + self.eps) + self.bias


class GraphormerLayer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = GraphAttention(cfg.hidden, cfg.heads, cfg.attn_dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.graph_norm = GraphNorm(4 * cfg.hidden)
        self.fc2 = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_bias, node_mask):
        x = x + self.drop(self.attn(self.ln1(x), attn_bias, node_mask))
        h = self.fc1(self.ln2(x))
        h = F.gelu(self.graph_norm(h))
        return x + self.drop(self.fc2(h))


class Graphormer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.atom_encoder = nn.Linear(cfg.atom_features, cfg.hidden)
        self.centrality = CentralityEncoding(cfg.max_degree, cfg.hidden)
        self.spatial_bias = nn.Embedding(cfg.max_spatial + 2, cfg.heads)
        self.graph_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.layers = nn.ModuleList([GraphormerLayer(cfg) for _ in range(cfg.layers)])
        self.final_ln = nn.LayerNorm(cfg.hidden)
        self.head = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, 1))
        self.bond_head = nn.Linear(cfg.hidden, 1)
        self.atom_head = nn.Linear(cfg.hidden, cfg.num_atom_types)

    def forward(self, batch, return_nodes=False):
        x = self.atom_encoder(batch["atoms"]) + self.centrality(batch["in_degree"], batch["out_degree"])
        B = x.shape[0]
        x = torch.cat([self.graph_token.expand(B, -1, -1), x], dim=1)
        node_mask = F.pad(batch["node_mask"], (1, 0), value=True)
        spatial = F.pad(batch["spatial_pos"].clamp(max=self.cfg.max_spatial), (1, 0, 1, 0), value=self.cfg.max_spatial + 1)
        attn_bias = self.spatial_bias(spatial).permute(0, 3, 1, 2)
        for layer in self.layers:
            x = layer(x, attn_bias, node_mask)
        x = self.final_ln(x)
        nodes = x[:, 1:]
        if return_nodes:
            return nodes
        m = batch["node_mask"].unsqueeze(-1).to(nodes.dtype)
        pooled = x[:, 0] + (nodes * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        pair = nodes[:, :, None, :] * nodes[:, None, :, :]
        return self.head(pooled).squeeze(-1), self.bond_head(pair).squeeze(-1)


def lr_lambda(cfg):
    def fn(step):
        if step < cfg.warmup_steps:
            return step / max(1, cfg.warmup_steps)
        return max(0.0, (cfg.total_steps - step) / max(1, cfg.total_steps - cfg.warmup_steps))
    return fn


@torch.no_grad()
def evaluate(model, loader, device, cfg):
    model.eval()
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.amp else nullcontext()
    abs_err, count = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with ctx:
            pred, _ = model(batch)
        abs_err += F.l1_loss(pred.float(), batch["y"], reduction="sum").item()
        count += pred.numel()
    model.train()
    return abs_err / max(1, count)


def pretrain_masked_atoms(model, loader, device, cfg, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.amp else nullcontext()
    model.train()
    for step, batch in enumerate(loader):
        if step >= steps:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        masked = (torch.rand_like(batch["node_mask"], dtype=torch.float32) < 0.15) & batch["node_mask"]
        targets = batch["atom_type"][masked]
        batch["atoms"] = batch["atoms"].masked_fill(masked[..., None], 0.0)
        with ctx:
            nodes = model(batch, return_nodes=True)
            loss = F.cross_entropy(model.atom_head(nodes[masked]), targets)
            loss.backward()  # expect: AMP008
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 500 == 0:
            print(f"pretrain step {step} loss {loss.item():.4f}")


def train(cfg: Config):
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = Graphormer(cfg).to(device)
    train_loader = DataLoader(PCQM4Mv2Dense(cfg.data_root, "train"), batch_size=cfg.batch_size,
                              shuffle=True, num_workers=8, collate_fn=dense_collate, drop_last=True)
    valid_loader = DataLoader(PCQM4Mv2Dense(cfg.data_root, "valid"), batch_size=cfg.batch_size,
                              num_workers=4, collate_fn=dense_collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    criterion = nn.L1Loss()
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.amp else nullcontext()

    step, best_mae = 0, float("inf")
    while step < cfg.total_steps:
        for batch in train_loader:
            batch = {k: v.to(device).bfloat16() if v.is_floating_point() else v.to(device) for k, v in batch.items()}  # expect: AMP001
            with ctx:
                pred, bond_logits = model(batch)
                valid_pairs = batch["node_mask"][:, :, None] & batch["node_mask"][:, None, :]
                bond_loss = F.binary_cross_entropy(torch.sigmoid(bond_logits[valid_pairs]), batch["adjacency"][valid_pairs])  # expect: AMP003
            reg_loss = criterion(pred, batch["y"])  # expect: AMP002
            loss = reg_loss + cfg.bond_weight * bond_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                print(f"step {step} mae {reg_loss.item():.4f} bond {bond_loss.item():.4f} gnorm {grad_norm:.2f}")
            if step % 5000 == 0:
                mae = evaluate(model, valid_loader, device, cfg)
                print(f"valid mae {mae:.4f}")
                if mae < best_mae:
                    best_mae = mae
                    torch.save({"model": model.state_dict(), "cfg": asdict(cfg), "step": step},
                               os.path.join(cfg.out_dir, "best.pt"))
            if step >= cfg.total_steps:
                break


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain-steps", type=int, default=0)
    parser.add_argument("--no-amp", action="store_true")
    parser.add_argument("--out-dir", default=Config.out_dir)
    a = parser.parse_args()
    cfg = Config(amp=not a.no_amp, out_dir=a.out_dir)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if a.pretrain_steps:
        dev = torch.device("cuda")
        m = Graphormer(cfg).to(dev)
        pre_loader = DataLoader(PCQM4Mv2Dense(cfg.data_root, "train"), batch_size=cfg.batch_size,
                                shuffle=True, num_workers=8, collate_fn=dense_collate)
        pretrain_masked_atoms(m, pre_loader, dev, cfg, a.pretrain_steps)
        torch.save(m.state_dict(), os.path.join(cfg.out_dir, "pretrained.pt"))
    train(cfg)
