"""Temporal Graph Network (Rossi et al., 2020) for future-link prediction on
interaction streams (Wikipedia / Reddit / MOOC in the JODIE format).

Memory (GRU updater) + temporal graph embedding (attention / sum / mean over
sampled temporal neighbours) + MLP link decoder. Mixed precision: fp16 autocast
with a GradScaler when --amp is given.
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score

from tgn_utils.data import RandEdgeSampler, TemporalNeighborSampler, load_interaction_stream
from tgn_utils.early_stop import EarlyStopMonitor

logger = logging.getLogger("tgn")


class TimeEncoder(nn.Module):
    """cos(w * dt + b) with log-spaced initial frequencies (TGAT)."""

    def __init__(self, dim):
        super().__init__()
        self.w = nn.Linear(1, dim)
        freqs = 1.0 / 10 ** np.linspace(0, 9, dim, dtype=np.float32)
        self.w.weight = nn.Parameter(torch.from_numpy(freqs).reshape(dim, 1))
        self.w.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, dt):
        return torch.cos(self.w(dt.unsqueeze(-1)))


class Memory(nn.Module):
    def __init__(self, num_nodes, memory_dim):
        super().__init__()
        self.register_buffer("memory", torch.zeros(num_nodes, memory_dim))
        self.register_buffer("last_update", torch.zeros(num_nodes))

    def reset(self):
        self.memory.zero_()
        self.last_update.zero_()

    def detach(self):
        self.memory.detach_()


class PairNorm(nn.Module):
    """PairNorm (Zhao & Akoglu, ICLR 2020) against over-smoothing."""

    def __init__(self, mode="PN", scale=1.0):
        super().__init__()
        assert mode in ["None", "PN", "PN-SI", "PN-SCS"]
        self.mode = mode
        self.scale = scale

    def forward(self, x):
        if self.mode == "None":
            return x
        col_mean = x.mean(dim=0)  # expect: AMP004
        if self.mode == "PN":
            x = x - col_mean
            rownorm_mean = (1e-6 + x.pow(2).sum(dim=1).mean()).sqrt()
            x = self.scale * x / rownorm_mean
        if self.mode == "PN-SI":
            x = x - col_mean
            rownorm_individual = (1e-6 + x.pow(2).sum(dim=1, keepdim=True)).sqrt()
            x = self.scale * x / rownorm_individual
        if self.mode == "PN-SCS":
            rownorm_individual = (1e-6 + x.pow(2).sum(dim=1, keepdim=True)).sqrt()
            x = self.scale * x / rownorm_individual - col_mean
        return x


class EmbeddingModule(nn.Module):
    """Shared neighbour gathering; subclasses implement ``aggregate``."""

    def __init__(self, node_dim, edge_dim, time_dim, out_dim, pairnorm="None"):
        super().__init__()
        self.time_encoder = TimeEncoder(time_dim)
        self.merge = nn.Linear(node_dim + out_dim, out_dim)
        self.norm = PairNorm(pairnorm) if pairnorm != "None" else nn.Identity()

    def forward(self, h_src, t_src, h_nbr, e_nbr, dt_nbr, nbr_mask):
        t_src_enc = self.time_encoder(torch.zeros_like(t_src))
        t_nbr_enc = self.time_encoder(dt_nbr)
        agg = self.aggregate(h_src, t_src_enc, h_nbr, e_nbr, t_nbr_enc, nbr_mask)
        z = self.merge(torch.cat([h_src, agg], dim=-1))
        return self.norm(z)


class GraphAttentionEmbedding(EmbeddingModule):
    def __init__(self, node_dim, edge_dim, time_dim, out_dim, n_heads=2, dropout=0.1, pairnorm="None"):
        super().__init__(node_dim, edge_dim, time_dim, out_dim, pairnorm)
        self.n_heads = n_heads
        self.q_proj = nn.Linear(node_dim + time_dim, out_dim)
        self.k_proj = nn.Linear(node_dim + edge_dim + time_dim, out_dim)
        self.v_proj = nn.Linear(node_dim + edge_dim + time_dim, out_dim)
        self.out_proj = nn.Linear(out_dim, out_dim)
        self.dropout = nn.Dropout(dropout)

    def aggregate(self, h_src, t_src, h_nbr, e_nbr, t_nbr, nbr_mask):
        b, k, _ = h_nbr.shape
        dh = self.q_proj.out_features // self.n_heads
        q = self.q_proj(torch.cat([h_src, t_src], dim=-1)).view(b, self.n_heads, 1, dh)
        kv_in = torch.cat([h_nbr, e_nbr, t_nbr], dim=-1)
        key = self.k_proj(kv_in).view(b, k, self.n_heads, dh).transpose(1, 2)
        val = self.v_proj(kv_in).view(b, k, self.n_heads, dh).transpose(1, 2)
        scores = torch.matmul(q, key.transpose(-1, -2)) / math.sqrt(dh)
        scores = scores.masked_fill(~nbr_mask[:, None, None, :], -1e10)  # expect: AMP007
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, val).reshape(b, -1)
        return self.out_proj(out)


class GraphSumEmbedding(EmbeddingModule):
    def __init__(self, node_dim, edge_dim, time_dim, out_dim, pairnorm="None"):
        super().__init__(node_dim, edge_dim, time_dim, out_dim, pairnorm)
        self.msg_proj = nn.Linear(node_dim + edge_dim + time_dim, out_dim)

    def aggregate(self, h_src, t_src, h_nbr, e_nbr, t_nbr, nbr_mask):
        msg = F.relu(self.msg_proj(torch.cat([h_nbr, e_nbr, t_nbr], dim=-1)))
        msg = msg.masked_fill(~nbr_mask.unsqueeze(-1), 0.0)
        return msg.sum(dim=1)


class GraphMeanEmbedding(GraphSumEmbedding):
    def aggregate(self, h_src, t_src, h_nbr, e_nbr, t_nbr, nbr_mask):
        msg = F.relu(self.msg_proj(torch.cat([h_nbr, e_nbr, t_nbr], dim=-1)))
        return msg.mean(dim=1)  # expect: AMP004


EMBEDDINGS = {
    "graph_attention": GraphAttentionEmbedding,
    "graph_sum": GraphSumEmbedding,
    "graph_mean": GraphMeanEmbedding,
}


class LinkPredictor(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(2 * dim, dim)
        self.fc2 = nn.Linear(dim, 1)

    def forward(self, z_src, z_dst):
        return self.fc2(F.relu(self.fc1(torch.cat([z_src, z_dst], dim=-1)))).squeeze(-1)


class TGN(nn.Module):
    def __init__(self, node_features, edge_features, neighbor_sampler, cfg):
        super().__init__()
        self.register_buffer("node_features", torch.as_tensor(node_features, dtype=torch.float32))
        self.register_buffer("edge_features", torch.as_tensor(edge_features, dtype=torch.float32))
        self.sampler = neighbor_sampler
        self.n_neighbors = cfg.n_neighbors
        num_nodes, node_dim = self.node_features.shape
        edge_dim = self.edge_features.size(1)
        self.memory = Memory(num_nodes, node_dim)
        self.msg_time = TimeEncoder(cfg.time_dim)
        raw_dim = 2 * node_dim + edge_dim + cfg.time_dim
        self.message_fn = nn.Sequential(nn.Linear(raw_dim, raw_dim // 2), nn.ReLU(), nn.Linear(raw_dim // 2, cfg.msg_dim))
        self.updater = nn.GRUCell(cfg.msg_dim, node_dim)
        extra = {"n_heads": cfg.n_heads} if cfg.embedding == "graph_attention" else {}
        self.embedding = EMBEDDINGS[cfg.embedding](node_dim, edge_dim, cfg.time_dim, node_dim, pairnorm=cfg.pairnorm, **extra)
        self.link_predictor = LinkPredictor(node_dim)

    def updated_memory(self, src, dst, ts, edge_idxs):
        mem = self.memory.memory.clone()
        nodes = torch.cat([src, dst])
        other = torch.cat([dst, src])
        dt = (ts.repeat(2) - self.memory.last_update[nodes]).float()
        raw = torch.cat([mem[nodes], mem[other], self.edge_features[edge_idxs].repeat(2, 1), self.msg_time(dt)], dim=-1)
        msg = self.message_fn(raw)
        mem[nodes] = self.updater(msg, mem[nodes]).to(mem.dtype)
        return mem

    def embed(self, mem, nodes, ts):
        nbr, nbr_eidx, nbr_t = self.sampler.get_temporal_neighbor(nodes, ts, self.n_neighbors)
        nbr_mask = nbr > 0
        h_src = mem[nodes] + self.node_features[nodes]
        h_nbr = mem[nbr] + self.node_features[nbr]
        e_nbr = self.edge_features[nbr_eidx]
        dt_nbr = (ts.unsqueeze(1) - nbr_t).float()
        return self.embedding(h_src, ts.float(), h_nbr, e_nbr, dt_nbr, nbr_mask)

    def forward(self, src, dst, neg, ts, edge_idxs):
        mem = self.updated_memory(src, dst, ts, edge_idxs)
        n = src.size(0)
        z = self.embed(mem, torch.cat([src, dst, neg]), ts.repeat(3))
        z_src, z_dst, z_neg = z[:n], z[n:2 * n], z[2 * n:]
        pos = self.link_predictor(z_src, z_dst).sigmoid()
        neg = self.link_predictor(z_src, z_neg).sigmoid()
        with torch.no_grad():
            nodes = torch.cat([src, dst])
            self.memory.memory[nodes] = mem[nodes].detach()
            self.memory.last_update[nodes] = ts.repeat(2).float()
        return pos, neg


def train_epoch(model, stream, neg_sampler, optimizer, scaler, args):
    model.train()
    criterion = nn.BCELoss()
    model.memory.reset()
    losses = []
    for start in range(0, len(stream.src), args.batch_size):
        sl = slice(start, start + args.batch_size)
        src, dst, ts, eidx = (torch.as_tensor(a[sl], device=args.device) for a in
                              (stream.src, stream.dst, stream.ts, stream.edge_idxs))
        _, neg = neg_sampler.sample(src.size(0))
        neg = torch.as_tensor(neg, device=args.device)
        ones = torch.ones(src.size(0), device=args.device)
        zeros = torch.zeros(src.size(0), device=args.device)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            pos_prob, neg_prob = model(src, dst, neg, ts, eidx)
            loss = criterion(pos_prob, ones) + criterion(neg_prob, zeros)  # expect: AMP003
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        model.memory.detach()
        losses.append(loss.item())
    return float(np.mean(losses))


@torch.no_grad()
def eval_link_prediction(model, stream, neg_sampler, args):
    model.eval()
    aps, aucs = [], []
    for start in range(0, len(stream.src), args.batch_size):
        sl = slice(start, start + args.batch_size)
        src, dst, ts, eidx = (torch.as_tensor(a[sl], device=args.device) for a in
                              (stream.src, stream.dst, stream.ts, stream.edge_idxs))
        _, neg = neg_sampler.sample(src.size(0))
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            pos_prob, neg_prob = model(src, dst, torch.as_tensor(neg, device=args.device), ts, eidx)
        scores = torch.cat([pos_prob, neg_prob]).float().cpu().numpy()
        labels = np.concatenate([np.ones(src.size(0)), np.zeros(src.size(0))])
        aps.append(average_precision_score(labels, scores))
        aucs.append(roc_auc_score(labels, scores))
    return float(np.mean(aps)), float(np.mean(aucs))


def main():
    parser = argparse.ArgumentParser("TGN self-supervised link prediction")
    parser.add_argument("-d", "--data", default="wikipedia")
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--n-epoch", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--n-neighbors", type=int, default=10)
    parser.add_argument("--n-heads", type=int, default=2)
    parser.add_argument("--time-dim", type=int, default=100)
    parser.add_argument("--msg-dim", type=int, default=100)
    parser.add_argument("--embedding", default="graph_attention", choices=sorted(EMBEDDINGS))
    parser.add_argument("--pairnorm", default="None", choices=["None", "PN", "PN-SI", "PN-SCS"])
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--save-dir", default="saved_models")
    args = parser.parse_args()
    args.device = "cuda"
    logging.basicConfig(level=logging.INFO)

    full, train, val, test, node_feats, edge_feats = load_interaction_stream(args.data)
    sampler = TemporalNeighborSampler(full, uniform=False)
    train_neg = RandEdgeSampler(train.src, train.dst)
    val_neg = RandEdgeSampler(full.src, full.dst, seed=0)

    model = TGN(node_feats, edge_feats, sampler, args).to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    monitor = EarlyStopMonitor(max_round=args.patience)
    os.makedirs(args.save_dir, exist_ok=True)
    ckpt = os.path.join(args.save_dir, f"tgn-{args.data}.pth")

    for epoch in range(args.n_epoch):
        t0 = time.time()
        train_loss = train_epoch(model, train, train_neg, optimizer, scaler, args)
        val_ap, val_auc = eval_link_prediction(model, val, val_neg, args)
        logger.info("epoch %d  loss %.4f  val ap %.4f auc %.4f  (%.0fs)",
                    epoch, train_loss, val_ap, val_auc, time.time() - t0)
        if monitor.early_stop_check(val_ap):
            logger.info("no improvement for %d epochs, stopping", args.patience)
            break
        torch.save(model.state_dict(), ckpt)


if __name__ == "__main__":
    main()
