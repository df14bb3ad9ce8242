"""DCN-V2 + field self-attention + MMoE for joint CTR / CVR (ESMM) training.

Runs on CPU nodes (AMX) with bf16 autocast; no loss scaling is needed for bf16.

    OMP_NUM_THREADS=56 python train_dcn.py --data /data/ali-ccp --bf16
"""
import argparse
import logging
import math
import os
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader

from recdata.aliccp import AliCCPDataset, FIELD_DIMS, NUM_DENSE

logger = logging.getLogger("dcn_mmoe")


class FeatureEmbedding(nn.Module):
    def __init__(self, field_dims, embed_dim):
        super().__init__()
        self.embedding = nn.Embedding(int(sum(field_dims)), embed_dim)
        offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        self.register_buffer("offsets", torch.from_numpy(offsets), persistent=False)
        nn.init.xavier_uniform_(self.embedding.weight)

    def forward(self, x):
        return self.embedding(x + self.offsets)            # B, F, D


class FMInteraction(nn.Module):
    def forward(self, emb):
        square_of_sum = torch.sum(emb, dim=1) ** 2
        sum_of_square = torch.sum(emb * emb, dim=1)
        return 0.5 * torch.sum(square_of_sum - sum_of_square, dim=1, keepdim=True)


class CrossNetV2(nn.Module):
    def __init__(self, dim, num_layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_layers))

    def forward(self, x0):
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class FieldSelfAttention(nn.Module):
    """AutoInt interacting layer over the field embeddings."""

    def __init__(self, embed_dim, num_heads=2):
        super().__init__()
        self.h, self.d = num_heads, embed_dim // num_heads
        self.W_q = nn.Linear(embed_dim, embed_dim, bias=False)
        self.W_k = nn.Linear(embed_dim, embed_dim, bias=False)
        self.W_v = nn.Linear(embed_dim, embed_dim, bias=False)
        self.W_res = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, emb):
        B, n, D = emb.shape
        q = self.W_q(emb).view(B, n, self.h, self.d).transpose(1, 2)
        k = self.W_k(emb).view(B, n, self.h, self.d).transpose(1, 2)
        v = self.W_v(emb).view(B, n, self.h, self.d).transpose(1, 2)
        attn = torch.matmul(q, k.transpose(-1, -2)).div(math.sqrt(self.d)).softmax(dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, n, D)
        return F.relu(out + self.W_res(emb))


def mlp(in_dim, hidden, dropout):
    layers = []
    for h in hidden:
        layers += [nn.Linear(in_dim, h), nn.ReLU(), nn.Dropout(dropout)]
        in_dim = h
    return nn.Sequential(*layers)


class MMoE(nn.Module):
    def __init__(self, in_dim, expert_dim, num_experts, num_tasks):
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(in_dim, expert_dim), nn.ReLU(), nn.Linear(expert_dim, expert_dim))
            for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(in_dim, num_experts) for _ in range(num_tasks))

    def forward(self, x):
        expert_out = torch.stack([expert(x) for expert in self.experts], dim=1)     # B, E, H
        task_outs, gate_probs = [], []
        for gate in self.gates:
            g = torch.softmax(gate(x), dim=-1)
            gate_probs.append(g)
            task_outs.append((g.unsqueeze(-1) * expert_out).sum(dim=1))  # expect: AMP004
        return task_outs, gate_probs


def expert_balance(gate_probs):
    """Squared coefficient of variation of expert importance (Shazeer et al. 2017)."""
    importance = torch.stack(gate_probs, dim=0).sum(dim=1)  # expect: AMP004
    imp_mean = importance.mean(dim=-1)  # expect: AMP004
    imp_std = importance.std(dim=-1)  # expect: AMP004
    cv = (imp_std / (imp_mean + 1e-10)).float()
    return (cv ** 2).mean()


class MTLOutput(NamedTuple):
    ctr_logit: torch.Tensor
    cvr_logit: torch.Tensor
    p_ctcvr: torch.Tensor
    balance: torch.Tensor


class DCNMMoE(nn.Module):
    def __init__(self, field_dims, num_dense, cfg):
        super().__init__()
        self.embed = FeatureEmbedding(field_dims, cfg.embed_dim)
        n_fields = len(field_dims)
        in_dim = n_fields * cfg.embed_dim + num_dense
        self.fm = FMInteraction()
        self.cross = CrossNetV2(in_dim, cfg.cross_layers)
        self.deep = mlp(in_dim, cfg.deep_hidden, cfg.dropout)
        self.field_attn = FieldSelfAttention(cfg.embed_dim, cfg.attn_heads)
        shared_dim = in_dim + cfg.deep_hidden[-1] + cfg.embed_dim + 1
        self.mmoe = MMoE(shared_dim, cfg.expert_dim, cfg.num_experts, num_tasks=2)
        self.ctr_tower = nn.Linear(cfg.expert_dim, 1)
        self.cvr_tower = nn.Linear(cfg.expert_dim, 1)

    def forward(self, dense, sparse):
        emb = self.embed(sparse)
        x0 = torch.cat([emb.flatten(1), torch.log1p(dense.clamp_min(0))], dim=1)
        att_pooled = self.field_attn(emb).sum(dim=1)  # expect: AMP004
        shared = torch.cat([self.cross(x0), self.deep(x0), att_pooled, self.fm(emb)], dim=1)
        (ctr_h, cvr_h), gate_probs = self.mmoe(shared)
        ctr_logit = self.ctr_tower(ctr_h).squeeze(-1)
        cvr_logit = self.cvr_tower(cvr_h).squeeze(-1)
        p_ctcvr = torch.stack([torch.sigmoid(ctr_logit), torch.sigmoid(cvr_logit)], dim=-1).prod(dim=-1)
        return MTLOutput(ctr_logit, cvr_logit, p_ctcvr, expert_balance(gate_probs))


def train_epoch(model, loader, optimizer, args, epoch):
    model.train()
    criterion = nn.BCEWithLogitsLoss()
    t0, seen = time.time(), 0
    for it, (dense, sparse, click, conversion) in enumerate(loader):
        click, conversion = click.float(), conversion.float()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            out = model(dense, sparse)
            loss_ctr = criterion(out.ctr_logit, click)
        loss_ctcvr = F.binary_cross_entropy(out.p_ctcvr.float(), conversion)
        clicked = click > 0
        loss_cvr = criterion(out.cvr_logit[clicked], conversion[clicked])  # expect: AMP002
        loss = loss_ctr + args.ctcvr_weight * loss_ctcvr + args.cvr_weight * loss_cvr + args.balance_weight * out.balance

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        seen += click.shape[0]
        if it % args.log_every == 0:
            logger.info("epoch %d it %d loss %.5f ctr %.5f ctcvr %.5f (%.0f samples/s)", epoch, it, loss.item(),
                        loss_ctr.item(), loss_ctcvr.item(), seen / (time.time() - t0))


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    ctr_p, cvr_p, clicks, convs = [], [], [], []
    for dense, sparse, click, conversion in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            out = model(dense, sparse)
        ctr_p.append(torch.sigmoid(out.ctr_logit.float()))
        cvr_p.append(out.p_ctcvr.float())
        clicks.append(click)
        convs.append(conversion)
    ctr_p, cvr_p = torch.cat(ctr_p).numpy(), torch.cat(cvr_p).numpy()
    return {"ctr_auc": roc_auc_score(torch.cat(clicks).numpy(), ctr_p),
            "ctcvr_auc": roc_auc_score(torch.cat(convs).numpy(), cvr_p)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--embed_dim", type=int, default=16)
    parser.add_argument("--cross_layers", type=int, default=3)
    parser.add_argument("--deep_hidden", type=int, nargs="+", default=[512, 256])
    parser.add_argument("--attn_heads", type=int, default=2)
    parser.add_argument("--expert_dim", type=int, default=128)
    parser.add_argument("--num_experts", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--clip", type=float, default=10.0)
    parser.add_argument("--ctcvr_weight", type=float, default=1.0)
    parser.add_argument("--cvr_weight", type=float, default=0.3)
    parser.add_argument("--balance_weight", type=float, default=1e-2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--log_every", type=int, default=200)
    parser.add_argument("--save_dir", default="ckpt/dcn_mmoe")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(args.save_dir, exist_ok=True)
    torch.manual_seed(2024)

    train_set = AliCCPDataset(args.data, split="train")
    test_set = AliCCPDataset(args.data, split="test")
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=8 * args.batch_size, num_workers=8)

    model = DCNMMoE(FIELD_DIMS, NUM_DENSE, args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-8)
    best = 0.0
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, args, epoch)
        metrics = evaluate(model, test_loader, args)
        logger.info("epoch %d: %s", epoch, metrics)
        if metrics["ctcvr_auc"] > best:
            best = metrics["ctcvr_auc"]
            torch.save({"model": model.state_dict(), "args": vars(args), "epoch": epoch},
                       os.path.join(args.save_dir, "best.pt"))


if __name__ == "__main__":
    main()
