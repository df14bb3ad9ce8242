"""Edge-gated message passing network for molecular property regression (QM9).

    python train_mpnn.py --target 7 --norm pair --readout attn --amp
    python train_mpnn.py --finetune_head --ckpt runs/qm9/best.pt --fp16
"""
import argparse
import copy
import json
import logging
import os
import random
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from molgraph.data import QM9Graphs, GraphLoader   # project package
from molgraph.features import ATOM_FEATURE_DIM, BOND_FEATURE_DIM

log = logging.getLogger("mpnn")


class PairNorm(nn.Module):
    """PairNorm (Zhao & Akoglu, 2020), PN-SI variant."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        col_mean = x.mean(dim=0)  # expect: AMP004
        x = x - col_mean
        rownorm = (1e-6 + x.pow(2).sum(dim=1, keepdim=True)).sqrt()
        return self.scale * x / rownorm


def make_norm(kind, hidden):
    if kind == "pair":
        return PairNorm()
    if kind == "layer":
        return nn.LayerNorm(hidden)
    return nn.Identity()


class EdgeGatedConv(nn.Module):
    """Message passing with sigmoid edge gates normalised over each atom's in-edges."""

    def __init__(self, hidden, edge_dim):
        super().__init__()
        self.lin_src = nn.Linear(hidden, hidden)
        self.lin_dst = nn.Linear(hidden, hidden)
        self.lin_edge = nn.Linear(edge_dim, hidden)
        self.gate = nn.Linear(3 * hidden, 1)
        self.update = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, h, edge_index, edge_attr):
        src, dst = edge_index
        h_src = self.lin_src(h)[src]
        h_dst = self.lin_dst(h)[dst]
        e = self.lin_edge(edge_attr)
        score = torch.sigmoid(self.gate(torch.cat([h_src, h_dst, e], dim=-1)))
        denom = score.new_zeros(h.size(0), 1).index_add_(0, dst, score)
        alpha = score / (denom[dst] + 1e-16)  # expect: AMP011
        msg = alpha * (h_src + e)
        agg = msg.new_zeros(h.size(0), msg.size(-1)).index_add_(0, dst, msg)
        return self.update(torch.cat([self.lin_dst(h), agg], dim=-1))


class Readout(nn.Module):
    def __init__(self, hidden, mode="sum"):
        super().__init__()
        self.mode = mode
        if mode == "attn":
            self.gate_nn = nn.Linear(hidden, 1)

    def forward(self, x, batch, num_graphs):
        if self.mode == "sum":
            return x.new_zeros(num_graphs, x.size(-1)).index_add_(0, batch, x)
        if self.mode == "mean":
            graphs = [x[batch == g].mean(dim=0) for g in range(num_graphs)]  # expect: AMP004
            return torch.stack(graphs, dim=0)
        # global attention pooling; the per-graph softmax follows torch_geometric.utils.softmax
        gate = self.gate_nn(x)
        gate = (gate - gate.max()).exp()
        denom = gate.new_zeros(num_graphs, 1).index_add_(0, batch, gate)
        alpha = gate / (denom[batch] + 1e-16)
        weighted = alpha * x
        return weighted.new_zeros(num_graphs, x.size(-1)).index_add_(0, batch, weighted)


class PropertyHead(nn.Module):
    def __init__(self, hidden, num_targets):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, num_targets))

    def forward(self, g):
        return self.net(g)


class MPNN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.atom_encoder = nn.Linear(ATOM_FEATURE_DIM, cfg.hidden)
        self.convs = nn.ModuleList([EdgeGatedConv(cfg.hidden, BOND_FEATURE_DIM) for _ in range(cfg.num_layers)])
        self.norms = nn.ModuleList([make_norm(cfg.norm, cfg.hidden) for _ in range(cfg.num_layers)])
        self.node_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.readout = Readout(cfg.hidden, cfg.readout)
        self.head = PropertyHead(cfg.hidden, cfg.num_targets)
        self.dropout = cfg.dropout

    def embed(self, data):
        h = self.atom_encoder(data.x)
        for conv, norm in zip(self.convs, self.norms):
            h = h + F.dropout(F.silu(norm(conv(h, data.edge_index, data.edge_attr))), self.dropout, self.training)
        node_repr = self.node_proj(h)
        return self.readout(node_repr, data.batch, data.num_graphs)

    def forward(self, data):
        return self.head(self.embed(data))


def build_model(cfg):
    return MPNN(cfg)


# --------------------------------------------------------------------------- #
def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def train_epoch(model, loader, optimizer, scaler, cfg, target_stats, device):
    model.train()
    mean, std = target_stats
    total, count = 0.0, 0
    optimizer.zero_grad(set_to_none=True)
    for step, data in enumerate(loader):
        data = data.to(device)
        target = (data.y[:, cfg.targets] - mean) / std
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            pred = model(data)
            loss = F.l1_loss(pred, target)
        total += loss.item() * data.num_graphs
        count += data.num_graphs
        loss = scaler.scale(loss / cfg.accum_steps)
        loss.backward()
        if (step + 1) % cfg.accum_steps == 0:
            if cfg.clip > 0:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            optimizer.step()  # expect: AMP006
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return total / count


@torch.no_grad()
def evaluate(model, loader, cfg, target_stats, device):
    model.eval()
    mean, std = target_stats
    errs = []
    for data in loader:
        data = data.to(device)
        pred = model(data) * std + mean
        errs.append((pred - data.y[:, cfg.targets]).abs().cpu())
    return torch.cat(errs).mean(dim=0)


@torch.no_grad()
def cache_embeddings(model, loader, device, half=False):
    model.eval()
    feats, ys = [], []
    for data in loader:
        data = data.to(device)
        g = model.embed(data)
        feats.append(g.half() if half else g.float())
        ys.append(data.y)
    return torch.cat(feats), torch.cat(ys)


def finetune_head(cfg, model, train_loader, device):
    """Re-fit a fresh property head on frozen, cached graph embeddings."""
    feats, ys = cache_embeddings(model, train_loader, device, half=cfg.fp16)
    targets = ys[:, cfg.targets].float()
    mean, std = targets.mean(dim=0), targets.std(dim=0)
    head = PropertyHead(cfg.hidden, len(cfg.targets)).to(device)
    if cfg.fp16:
        head = head.half()
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.head_lr, weight_decay=cfg.weight_decay)  # expect: AMP011
    n = feats.size(0)
    for epoch in range(cfg.head_epochs):
        perm = torch.randperm(n, device=device)
        for idx in perm.split(cfg.batch_size):
            pred = head(feats[idx])
            loss = F.mse_loss(pred.float(), (targets[idx] - mean) / std)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        log.info("head epoch %d loss %.5f", epoch, loss.item())
    return head


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/qm9_mpnn.json")
    p.add_argument("--target", type=int, nargs="+", default=[7])
    p.add_argument("--norm", default="pair", choices=["pair", "layer", "none"])
    p.add_argument("--readout", default="attn", choices=["sum", "mean", "attn"])
    p.add_argument("--amp", action="store_true")
    p.add_argument("--fp16", action="store_true", help="pure fp16 head when fine-tuning")
    p.add_argument("--finetune_head", action="store_true")
    p.add_argument("--ckpt", default="")
    p.add_argument("--out", default="runs/qm9")
    args = p.parse_args()

    with open(args.config) as f:
        cfg = SimpleNamespace(**json.load(f))
    cfg.targets, cfg.num_targets = args.target, len(args.target)
    cfg.norm, cfg.readout, cfg.amp, cfg.fp16 = args.norm, args.readout, args.amp, args.fp16
    seed_everything(cfg.seed)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    dataset = QM9Graphs(cfg.root)
    train_set, valid_set, test_set = dataset.split(cfg.split_seed)
    train_loader = GraphLoader(train_set, batch_size=cfg.batch_size, shuffle=True)
    valid_loader = GraphLoader(valid_set, batch_size=256)
    test_loader = GraphLoader(test_set, batch_size=256)

    model = build_model(cfg).to(device)
    if args.finetune_head:
        model.load_state_dict(torch.load(args.ckpt, map_location=device)["model"])
        for param in model.parameters():
            param.requires_grad_(False)
        head = finetune_head(cfg, model, train_loader, device)
        model.head = head.float()
        log.info("test MAE %s", evaluate(model, test_loader, cfg, (0.0, 1.0), device).tolist())
        return

    ys = torch.cat([d.y[:, cfg.targets] for d in train_set])
    target_stats = (ys.mean(dim=0).to(device), ys.std(dim=0).to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.7, patience=5)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp)

    best_val = float("inf")
    for epoch in range(1, cfg.epochs + 1):
        train_mae = train_epoch(model, train_loader, optimizer, scaler, cfg, target_stats, device)
        val_mae = evaluate(model, valid_loader, cfg, target_stats, device).mean().item()
        scheduler.step(val_mae)
        log.info("epoch %03d train %.4f valid %.4f lr %.2e", epoch, train_mae, val_mae,
                 optimizer.param_groups[0]["lr"])
        if val_mae < best_val:
            best_val = val_mae
            torch.save({"model": model.state_dict(), "cfg": vars(cfg), "epoch": epoch},
                       os.path.join(args.out, "best.pt"))
    test_mae = evaluate(model, test_loader, cfg, target_stats, device)
    log.info("test MAE per target %s", test_mae.tolist())


if __name__ == "__main__":
    main()
