"""E(n)-equivariant GNN for refining predicted protein backbones.

Residues are nodes (CA atoms), edges connect residues within a radius cutoff.
Each layer updates invariant node features and, in the second half of the
stack, the CA coordinates.  Two heads predict per-residue pLDDT bins and a
binned distogram over edges.

Based on the EGNN reference implementation (Satorras et al., 2021) with
NodeNorm (Zhou et al., 2020) between layers.
"""
import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from proteinrefine.data import ResidueGraphDataset, collate_graphs

NUM_PLDDT_BINS = 50


@dataclass
class EGNNOutput:
    node_feats: torch.Tensor
    coords: torch.Tensor
    plddt_logits: torch.Tensor
    distogram_logits: torch.Tensor


def rbf_encode(dist, num_rbf=16, d_min=2.0, d_max=22.0):
    """Gaussian radial basis of CA-CA distances (geometry stays fp32)."""
    centers = torch.linspace(d_min, d_max, num_rbf, device=dist.device)
    sigma = (d_max - d_min) / num_rbf
    return torch.exp(-(((dist - centers) / sigma) ** 2))


def aggregate(messages, index, num_nodes):
    out = torch.zeros(num_nodes, messages.size(-1), device=messages.device, dtype=messages.dtype)
    out.index_add_(0, index, messages)
    deg = torch.bincount(index, minlength=num_nodes).clamp(min=1).unsqueeze(-1)
    return out / deg


def message_stats(m):
    """Per-edge spread of the message vector; used as an attention temperature."""
    return m.std(dim=-1, keepdim=True)  # expect: AMP004


class NodeNorm(nn.Module):
    """Normalise every node by the statistics of its own feature vector."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, h):
        mu = h.mean(dim=-1, keepdim=True)  # expect: AMP004
        var = h.var(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
        h = (h - mu) / torch.sqrt(var + 1e-8)  # expect: AMP011
        return h * self.weight + self.bias


class EGNNLayer(nn.Module):
    def __init__(self, hidden, edge_dim, num_rbf=16, update_coords=True, act="silu"):
        super().__init__()
        act_layer = nn.SiLU if act == "silu" else nn.GELU
        self.edge_mlp = nn.Sequential(
            nn.Linear(2 * hidden + num_rbf + edge_dim, hidden),
            act_layer(),
            nn.Linear(hidden, hidden),
        )
        self.att = nn.Linear(hidden, 1)
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), act_layer(), nn.Linear(hidden, hidden))
        self.norm = NodeNorm(hidden)
        self.coord_mlp = None
        if update_coords:
            self.coord_mlp = nn.Sequential(nn.Linear(hidden, hidden), act_layer(), nn.Linear(hidden, 1, bias=False))
            nn.init.xavier_uniform_(self.coord_mlp[-1].weight, gain=0.001)

    def forward(self, h, coords, edge_index, edge_attr):
        row, col = edge_index
        rel = coords[row] - coords[col]
        dist = rel.norm(dim=-1, keepdim=True)
        m = self.edge_mlp(torch.cat([h[row], h[col], rbf_encode(dist), edge_attr], dim=-1))
        scale = message_stats(m)
        gate = torch.sigmoid(self.att(m) / (scale + 1e-8))  # expect: AMP011
        m = m * gate
        if self.coord_mlp is not None:
            # unit direction times a learned step; rel/dist are fp32 CA coordinates
            trans = rel / (dist + 1e-8) * self.coord_mlp(m)
            coords = coords + aggregate(trans, row, coords.size(0))
        agg = aggregate(m, row, h.size(0))
        h = h + self.norm(self.node_mlp(torch.cat([h, agg], dim=-1)))
        return h, coords


class EGNN(nn.Module):
    def __init__(self, cfg, hidden=None, n_layers=None):
        super().__init__()
        hidden = hidden or cfg.hidden
        n_layers = n_layers or cfg.n_layers
        self.embed = nn.Linear(cfg.node_dim, hidden)
        self.layers = nn.ModuleList(
            [EGNNLayer(hidden, cfg.edge_dim, update_coords=i >= n_layers // 2) for i in range(n_layers)]
        )
        self.heads = nn.ModuleDict(
            {
                "plddt": nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, NUM_PLDDT_BINS)),
                "distogram": nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, cfg.n_dist_bins)),
            }
        )

    def forward(self, node_feats, coords, edge_index, edge_attr):
        h = self.embed(node_feats)
        # centre each structure; coordinates come from the loader in fp32
        coords = coords - coords.mean(dim=0, keepdim=True)
        for layer in self.layers:
            h, coords = layer(h, coords, edge_index, edge_attr)
        row, col = edge_index
        return EGNNOutput(
            node_feats=h,
            coords=coords,
            plddt_logits=self.heads["plddt"](h),
            distogram_logits=self.heads["distogram"](torch.cat([h[row], h[col]], dim=-1)),
        )


MODELS = {
    "egnn": EGNN,
    "egnn-small": lambda cfg: EGNN(cfg, hidden=64, n_layers=4),
}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    bin_centers = (torch.arange(NUM_PLDDT_BINS, device=device) + 0.5) / NUM_PLDDT_BINS
    rmsd_sum, plddt_err, n = 0.0, 0.0, 0
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.node_feats, batch.coords, batch.edge_index, batch.edge_attr)
        sq = (out.coords - batch.coords_true).pow(2).sum(-1)
        rmsd_sum += torch.sqrt(sq.mean() + 1e-8).item()
        expected = (out.plddt_logits.float().softmax(-1) * bin_centers).sum(-1)
        plddt_err += (expected - batch.plddt).abs().mean().item()
        n += 1
    model.train()
    return {"rmsd": rmsd_sum / max(n, 1), "plddt_mae": plddt_err / max(n, 1)}


def train(cfg):
    device = torch.device("cuda")
    model = MODELS[cfg.arch](cfg)
    model.to(device)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema_decay)
    )
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler("cuda")
    train_loader = DataLoader(
        ResidueGraphDataset(cfg.data_root, split="train"),
        batch_size=cfg.batch_size, shuffle=True, collate_fn=collate_graphs, num_workers=4,
    )
    val_loader = DataLoader(
        ResidueGraphDataset(cfg.data_root, split="val"),
        batch_size=cfg.batch_size, collate_fn=collate_graphs, num_workers=2,
    )
    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        for it, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(batch.node_feats, batch.coords, batch.edge_index, batch.edge_attr)
                coord_loss = F.smooth_l1_loss(out.coords, batch.coords_true)
                plddt_loss = F.cross_entropy(out.plddt_logits, batch.plddt_bins)
                dist_loss = F.cross_entropy(out.distogram_logits, batch.dist_bins)
                loss = (coord_loss + 0.01 * plddt_loss + 0.3 * dist_loss) / cfg.accum_steps
            scaler.scale(loss).backward()
            if (it + 1) % cfg.accum_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                ema.update_parameters(model._orig_mod)
                step += 1
                if step % cfg.log_every == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item() * cfg.accum_steps:.4f}")
        metrics = evaluate(ema.module, val_loader, device)
        print(f"epoch {epoch} val rmsd {metrics['rmsd']:.3f} plddt mae {metrics['plddt_mae']:.4f}")
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save(
            {"model": model._orig_mod.state_dict(), "ema": ema.module.state_dict(),
             "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
            os.path.join(cfg.out_dir, "last.pt"),
        )


def parse_args():
    p = argparse.ArgumentParser(description="Train the EGNN refiner")
    p.add_argument("--data-root", required=True)
    p.add_argument("--out-dir", default="runs/egnn")
    p.add_argument("--arch", default="egnn", choices=sorted(MODELS))
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--node-dim", type=int, default=41)
    p.add_argument("--edge-dim", type=int, default=4)
    p.add_argument("--n-dist-bins", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


if __name__ == "__main__":
    train(parse_args())
