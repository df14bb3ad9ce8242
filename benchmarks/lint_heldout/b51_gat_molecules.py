"""Dense graph attention network for multi-task molecular property prediction (Tox21-like).

Molecules are padded to MAX_ATOMS; adjacency is a dense (B, N, N) 0/1 matrix.
    python b51_gat_molecules.py --data tox21_dense.npz --epochs 100
"""
import argparse
import math
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

MAX_ATOMS = 64
amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)


class GATLayer(nn.Module):
    def __init__(self, in_dim, out_dim, heads=4, dropout=0.1, negative_slope=0.2):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.W = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.a_src = nn.Linear(out_dim, 1, bias=False)
        self.a_dst = nn.Linear(out_dim, 1, bias=False)
        self.bond_att = nn.Linear(4, heads, bias=False)
        self.negative_slope = negative_slope
        self.dropout = nn.Dropout(dropout)

    def forward(self, h, adj, bonds):
        b, n, _ = h.shape
        wh = self.W(h).view(b, n, self.heads, self.out_dim).transpose(1, 2)  # (B, H, N, F)
        e = self.a_src(wh) + self.a_dst(wh).transpose(-1, -2)                 # (B, H, N, N)
        e = e + self.bond_att(bonds).permute(0, 3, 1, 2)
        e = F.leaky_relu(e, self.negative_slope)
        e = e.masked_fill(adj.unsqueeze(1) == 0, -9e15)  # expect: AMP007
        attn = self.dropout(torch.softmax(e, dim=-1))
        out = torch.matmul(attn, wh)                                           # (B, H, N, F)
        return F.elu(out.transpose(1, 2).reshape(b, n, self.heads * self.out_dim))


class PairNorm(nn.Module):
    """PairNorm (Zhao & Akoglu, 2020), 'PN-SI' variant, per graph."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    def forward(self, x, node_mask):
        x = x.masked_fill(~node_mask, 0.0)
        col_mean = x.mean(dim=1, keepdim=True)  # expect: AMP004
        x = (x - col_mean).masked_fill(~node_mask, 0.0)
        rownorm = (1e-6 + x.pow(2).sum(dim=-1, keepdim=True)).sqrt()
        return self.scale * x / rownorm


class MolGAT(nn.Module):
    def __init__(self, atom_dim, n_tasks, hidden=64, heads=4, n_layers=4, dropout=0.1):
        super().__init__()
        self.atom_encoder = nn.Linear(atom_dim, hidden * heads)
        self.layers = nn.ModuleList(
            [GATLayer(hidden * heads, hidden, heads, dropout) for _ in range(n_layers)]
        )
        self.norms = nn.ModuleList([PairNorm() for _ in range(n_layers)])
        self.recon_proj = nn.Linear(hidden * heads, hidden)
        self.head = nn.Sequential(
            nn.Linear(3 * hidden * heads, 256), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(256, n_tasks),
        )

    def readout(self, h, node_mask):
        n_atoms = node_mask.sum(1).clamp(min=1)
        h_sum = h.masked_fill(~node_mask, 0.0).sum(1)
        h_max = h.masked_fill(~node_mask, -1e4).amax(1)
        return torch.cat([h_sum, h_sum / n_atoms, h_max], dim=-1)

    def forward(self, atoms, adj, bonds, node_mask):
        h = self.atom_encoder(atoms)
        layer_outputs = []
        for layer, norm in zip(self.layers, self.norms):
            h_layer = layer(h, adj, bonds)
            layer_outputs.append(h_layer)
            h = norm(h_layer, node_mask)
        # jumping knowledge, "mean" mode
        h_jk = torch.stack(layer_outputs, dim=0).mean(dim=0)  # expect: AMP004
        logits = self.head(self.readout(h_jk, node_mask))

        # auxiliary bond reconstruction (VGAE-style inner-product decoder)
        z = self.recon_proj(h)
        p = torch.sigmoid(torch.matmul(z, z.transpose(1, 2)))
        adj_t = adj.float()
        pos = adj_t * torch.log(p + 1e-8)  # expect: AMP011
        neg = (1.0 - adj_t) * torch.log(1.0 - p + 1e-8)  # expect: AMP011
        pair_mask = (node_mask & node_mask.transpose(1, 2)).float()
        recon = -((pos + neg) * pair_mask).sum() / pair_mask.sum()
        return logits, recon


def load_dense_dataset(path):
    data = np.load(path)
    atoms = data["atoms"].astype(np.float32)          # (M, N, F)
    coords = data["coords"].astype(np.float32)        # (M, N, 3)
    coords = coords - coords.mean(axis=1, keepdims=True)
    adj = data["adj"].astype(np.int64)
    bonds = data["bonds"].astype(np.float32)          # (M, N, N, 4) one-hot bond types
    y = data["y"].astype(np.float32)
    w = (~np.isnan(y)).astype(np.float32)
    y = np.nan_to_num(y)
    node_mask = (atoms.sum(-1, keepdims=True) > 0)
    return [torch.from_numpy(a) for a in (atoms, adj, bonds, node_mask, y, w, coords)]


def make_pos_weight(y, w):
    n_pos = (y * w).sum(0)
    n_neg = ((1.0 - y) * w).sum(0)
    return n_neg / (n_pos + 1e-8)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, labels, weights = [], [], []
    for atoms, adj, bonds, node_mask, y, w, _ in loader:
        with amp_autocast():
            logits, _ = model(atoms.to(device), adj.to(device), bonds.to(device),
                              node_mask.to(device))
        probs.append(torch.sigmoid(logits.float()).cpu())
        labels.append(y)
        weights.append(w)
    model.train()
    p, y, w = torch.cat(probs), torch.cat(labels), torch.cat(weights)
    acc = (((p > 0.5).float() == y).float() * w).sum(0) / w.sum(0).clamp(min=1.0)
    return acc.mean().item()


def train(args):
    device = torch.device("cuda")
    tensors = load_dense_dataset(args.data)
    n_val = len(tensors[0]) // 10
    train_ds = TensorDataset(*[t[n_val:] for t in tensors])
    val_ds = TensorDataset(*[t[:n_val] for t in tensors])
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256)
    pos_weight = make_pos_weight(tensors[4][n_val:], tensors[5][n_val:]).to(device)

    model = MolGAT(tensors[0].shape[-1], tensors[4].shape[-1], n_layers=args.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5, eps=1e-8)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=total_steps, pct_start=0.05)
    scaler = torch.amp.GradScaler("cuda")
    best = 0.0
    for epoch in range(args.epochs):
        running = 0.0
        for atoms, adj, bonds, node_mask, y, w, _ in train_loader:
            atoms, adj, bonds = atoms.to(device), adj.to(device), bonds.to(device)
            node_mask, y, w = node_mask.to(device), y.to(device), w.to(device)
            with amp_autocast():
                logits, recon = model(atoms, adj, bonds, node_mask)
            task_loss = F.binary_cross_entropy_with_logits(logits, y, weight=w, pos_weight=pos_weight, reduction="sum") / w.sum()  # expect: AMP002
            loss = task_loss + args.recon_weight * recon
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += loss.item()
        val_acc = evaluate(model, val_loader, device)
        print(f"epoch {epoch:03d} loss {running / len(train_loader):.4f} val-acc {val_acc:.4f}")
        if val_acc > best:
            best = val_acc
            torch.save({"model": model.state_dict(), "epoch": epoch}, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="molgat.pt")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--recon-weight", type=float, default=0.1)
    train(p.parse_args())
