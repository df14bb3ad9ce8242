"""Graph attention network with edge features for molecular property prediction.

Graphs are padded to dense (B, N, N) adjacency; every head scores an edge from its
two endpoint projections plus a projection of the bond features. PairNorm between
layers, attention (or max) readout, multi-task BCE head, and an auxiliary
link-prediction loss on sampled positive / negative atom pairs.
"""
import argparse
import contextlib
import logging
import math
import os
import random
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphs.data import MoleculeDataset, dense_collate, sample_link_pairs
from graphs.metrics import masked_roc_auc

log = logging.getLogger("gat")

DEFAULTS = {
    "atom_types": 120, "bond_types": 24, "hidden": 64, "heads": 4, "edge_dim": 32, "layers": 4,
    "dropout": 0.1, "pairnorm_scale": 1.0, "pairnorm_mode": "PN", "readout": "attention", "num_tasks": 12,
}


class GraphOutput(NamedTuple):
    graph_logits: torch.Tensor
    pos_out: torch.Tensor
    neg_out: torch.Tensor


class GATHead(nn.Module):
    def __init__(self, in_dim, out_dim, edge_dim, dropout=0.1, alpha=0.2):
        super().__init__()
        self.W = nn.Linear(in_dim, out_dim, bias=False)
        self.W_e = nn.Linear(edge_dim, out_dim, bias=False)
        self.a = nn.Parameter(torch.empty(3 * out_dim, 1))
        nn.init.xavier_uniform_(self.a, gain=1.414)
        self.out_dim, self.alpha, self.dropout = out_dim, alpha, dropout

    def forward(self, x, adj, edge_attr):
        d = self.out_dim
        Wh = self.W(x)  # B, N, D
        We = self.W_e(edge_attr)  # B, N, N, D
        e_src = torch.matmul(Wh, self.a[:d])
        e_dst = torch.matmul(Wh, self.a[d:2 * d])
        e_edge = torch.matmul(We, self.a[2 * d:]).squeeze(-1)
        e = F.leaky_relu(e_src + e_dst.transpose(1, 2) + e_edge, self.alpha)
        zero_vec = torch.full_like(e, -9e15)  # expect: AMP007
        attention = torch.where(adj > 0, e, zero_vec)
        attention = F.softmax(attention, dim=-1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        return torch.matmul(attention, Wh)


class MultiHeadGAT(nn.Module):
    def __init__(self, in_dim, out_dim, edge_dim, heads=4, concat=True, dropout=0.1):
        super().__init__()
        self.heads = nn.ModuleList([GATHead(in_dim, out_dim, edge_dim, dropout) for _ in range(heads)])
        self.concat = concat

    def forward(self, x, adj, edge_attr):
        outs = [head(x, adj, edge_attr) for head in self.heads]
        if self.concat:
            return torch.cat(outs, dim=-1)
        return torch.stack(outs, dim=0).mean(dim=0)  # expect: AMP004


class PairNorm(nn.Module):
    """PairNorm (Zhao & Akoglu, 2020) over the nodes of each graph."""

    def __init__(self, scale=1.0, mode="PN"):
        super().__init__()
        self.scale, self.mode = scale, mode

    def forward(self, x):
        col_mean = x.mean(dim=1, keepdim=True)  # expect: AMP004
        x = x - col_mean
        if self.mode == "PN-SI":
            return self.scale * x / (1e-12 + x.pow(2).sum(dim=-1, keepdim=True)).sqrt()
        rownorm_mean = (1e-6 + x.pow(2).sum(dim=-1).mean()).sqrt()
        return self.scale * x / rownorm_mean


class GATEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H, heads, L = cfg["hidden"], cfg["heads"], cfg["layers"]
        self.node_encoder = nn.Embedding(cfg["atom_types"], H * heads)
        self.edge_encoder = nn.Sequential(nn.Embedding(cfg["bond_types"], cfg["edge_dim"], padding_idx=0), nn.ReLU(),
                                          nn.Linear(cfg["edge_dim"], cfg["edge_dim"]))
        self.layers = nn.ModuleList([
            MultiHeadGAT(H * heads, H if i < L - 1 else H * heads, cfg["edge_dim"], heads,
                         concat=i < L - 1, dropout=cfg["dropout"])
            for i in range(L)
        ])
        self.norms = nn.ModuleList([PairNorm(cfg["pairnorm_scale"], cfg["pairnorm_mode"]) for _ in range(L)])
        self.dropout = cfg["dropout"]

    def forward(self, x, adj, edge_attr):
        h = self.node_encoder(x)
        e = self.edge_encoder(edge_attr)
        for layer, norm in zip(self.layers, self.norms):
            h = norm(F.elu(layer(h, adj, e)))
            h = F.dropout(h, self.dropout, training=self.training)
        return h


class AttentionReadout(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_nn = nn.Sequential(nn.Linear(dim, dim // 2), nn.Tanh(), nn.Linear(dim // 2, 1))
        self.proj = nn.Linear(dim, dim)

    def forward(self, h, node_mask):
        gate = self.gate_nn(h).squeeze(-1)
        gate = gate.masked_fill(~node_mask, -1e9)  # expect: AMP007
        gate = torch.softmax(gate, dim=1)
        return torch.sum(gate.unsqueeze(-1) * self.proj(h), dim=1)


class MaxReadout(nn.Module):
    def forward(self, h, node_mask):
        h = h.masked_fill(~node_mask.unsqueeze(-1), torch.finfo(h.dtype).min)
        return h.max(dim=1).values


READOUTS = {"attention": AttentionReadout, "max": lambda dim: MaxReadout()}


class MolGAT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim = cfg["hidden"] * cfg["heads"]
        self.encoder = GATEncoder(cfg)
        self.readout = READOUTS[cfg["readout"]](dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(cfg["dropout"]),
                                  nn.Linear(dim, cfg["num_tasks"]))
        self.link_head = nn.Linear(dim, 1)

    def decode(self, h, pairs):
        b = torch.arange(h.size(0), device=h.device)[:, None]
        z = h[b, pairs[..., 0]] * h[b, pairs[..., 1]]
        return torch.sigmoid(self.link_head(z)).squeeze(-1)

    def forward(self, x, adj, edge_attr, node_mask, pos_pairs, neg_pairs):
        h = self.encoder(x, adj, edge_attr)
        g = self.readout(h, node_mask)
        return GraphOutput(self.head(g), self.decode(h, pos_pairs), self.decode(h, neg_pairs))


def build_model(cfg):
    return MolGAT(cfg)


class MultiTaskLinkLoss(nn.Module):
    def __init__(self, link_weight=0.1):
        super().__init__()
        self.link_weight = link_weight
        self.bce = nn.BCEWithLogitsLoss(reduction="none")

    def forward(self, out, y, y_mask):
        task_loss = self.bce(out.graph_logits, torch.nan_to_num(y))
        task_loss = (task_loss * y_mask).sum() / y_mask.sum().clamp(min=1)
        pos_loss = -torch.log(out.pos_out + 1e-15).mean()  # expect: AMP011
        neg_loss = -torch.log(1 - out.neg_out + 1e-15).mean()  # expect: AMP011
        link_loss = pos_loss + neg_loss
        return task_loss + self.link_weight * link_loss, {"task": task_loss.item(), "link": link_loss.item()}


def to_device(batch, device):
    return (batch["atom_type"].to(device), batch["adj"].to(device), batch["bond_type"].to(device),
            batch["node_mask"].to(device), batch["y"].to(device), batch["y_mask"].to(device))


def train_one_epoch(model, criterion, loader, optimizer, scaler, args, epoch):
    model.train()
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else contextlib.nullcontext()
    running = {"task": 0.0, "link": 0.0}
    for step, batch in enumerate(loader):
        x, adj, edge_attr, node_mask, y, y_mask = to_device(batch, args.device)
        pos_pairs, neg_pairs = sample_link_pairs(adj, node_mask, num=args.link_pairs)
        with ctx:
            out = model(x, adj, edge_attr, node_mask, pos_pairs, neg_pairs)
            loss, parts = criterion(out, y, y_mask)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        for k in running:
            running[k] += parts[k]
        if (step + 1) % args.log_every == 0:
            log.info("epoch %d step %d task %.4f link %.4f", epoch, step + 1,
                     running["task"] / args.log_every, running["link"] / args.log_every)
            running = {k: 0.0 for k in running}


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    preds, targets, masks = [], [], []
    for batch in loader:
        x, adj, edge_attr, node_mask, y, y_mask = to_device(batch, args.device)
        h = model.encoder(x, adj, edge_attr)
        logits = model.head(model.readout(h, node_mask))
        preds.append(torch.sigmoid(logits.float()).cpu())
        targets.append(y.cpu())
        masks.append(y_mask.cpu())
    return masked_roc_auc(torch.cat(preds), torch.cat(targets), torch.cat(masks))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="tox21")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--link-pairs", type=int, default=16)
    p.add_argument("--amp", action="store_true", help="fp16 autocast + GradScaler")
    p.add_argument("--pure-fp16", action="store_true", help="keep weights in fp16 (use without --amp)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/gat")
    args = p.parse_args()
    args.device = "cuda"
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_set, val_set, test_set = MoleculeDataset.scaffold_split(args.dataset)
    cfg = dict(DEFAULTS, num_tasks=train_set.num_tasks)
    loader = torch.utils.data.DataLoader(train_set, args.batch_size, shuffle=True, collate_fn=dense_collate)
    val_loader = torch.utils.data.DataLoader(val_set, args.batch_size, collate_fn=dense_collate)

    model = build_model(cfg).to(args.device)
    if args.pure_fp16:
        model = model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)  # expect: AMP011
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    criterion = MultiTaskLinkLoss(link_weight=0.1)

    best_auc, bad_epochs = 0.0, 0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, loader, optimizer, scaler, args, epoch)
        auc = evaluate(model, val_loader, args)
        if auc > best_auc:
            best_auc, bad_epochs = auc, 0
            torch.save({"model": model.state_dict(), "cfg": cfg, "epoch": epoch}, os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= 30:
                break
        log.info("epoch %d val auc %.4f (best %.4f)", epoch, auc, best_auc)


if __name__ == "__main__":
    main()
