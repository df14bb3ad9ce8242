"""Graph transformer with edge features and a virtual node for molecular
property regression (QM9 / PCQM4M-style scalar targets).

Batches use the PyG layout: x [N, F] integer atom features, edge_index [2, E],
edge_attr [E, B] integer bond features, batch [N] graph id of every atom.
Attention runs over the edges only (sparse, scatter based); a virtual node per
graph exchanges information between distant atoms.  The head predicts a mean
and a log-variance (heteroscedastic regression).

Training: CUDA fp16 autocast + GradScaler, EMA copy for validation.
"""
import argparse
import copy
import math
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

MolOutput = namedtuple("MolOutput", ["mu", "log_var", "graph_emb"])

ATOM_FEATURE_DIMS = [119, 5, 12, 12, 10, 6, 6, 2, 2]
BOND_FEATURE_DIMS = [5, 6, 2]


# --------------------------------------------------------------------------- #
# scatter helpers
# --------------------------------------------------------------------------- #
def scatter_sum(src, index, dim_size):
    out = src.new_zeros((dim_size,) + tuple(src.shape[1:]))
    return out.index_add_(0, index, src)


def scatter_softmax(scores, index, dim_size):
    """Softmax of edge scores [E, H] over the incoming edges of every node."""
    expanded = index.unsqueeze(-1).expand_as(scores)
    smax = scores.new_full((dim_size, scores.size(1)), float("-inf"))
    smax = smax.scatter_reduce(0, expanded, scores, reduce="amax", include_self=True)
    exp = (scores - smax[index]).exp()
    denom = scatter_sum(exp, index, dim_size)
    return exp / (denom[index] + 1e-16)


def global_mean_pool(h, batch, num_graphs):
    total = scatter_sum(h, batch, num_graphs)
    count = torch.bincount(batch, minlength=num_graphs).clamp(min=1)
    return total / count.unsqueeze(-1).to(total.dtype)


# --------------------------------------------------------------------------- #
# modules
# --------------------------------------------------------------------------- #
class FeatureEncoder(nn.Module):
    def __init__(self, feature_dims, dim):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, dim) for n in feature_dims)
        for table in self.tables:
            nn.init.xavier_uniform_(table.weight)

    def forward(self, feats):
        out = 0
        for i, table in enumerate(self.tables):
            out = out + table(feats[:, i])
        return out


class EdgeBiasedAttention(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.edge_bias = nn.Linear(dim, heads)
        self.edge_gate = nn.Linear(dim, heads)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, e, edge_index):
        src, dst = edge_index
        n = x.size(0)
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        scores = (q[dst] * k[src]).sum(-1) / math.sqrt(self.head_dim)
        scores = scores + self.edge_bias(e)
        attn = self.drop(scatter_softmax(scores, dst, n))
        gate = torch.sigmoid(self.edge_gate(e))
        gate = gate / (gate.mean(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004, AMP011
        msg = v[src] * (attn * gate).unsqueeze(-1)
        agg = scatter_sum(msg, dst, n)
        return self.out(agg.reshape(n, -1))


class GraphTransformerLayer(nn.Module):
    def __init__(self, dim, heads, dropout, ffn_mult=2):
        super().__init__()
        self.norm_attn = nn.LayerNorm(dim)
        self.attn = EdgeBiasedAttention(dim, heads, dropout)
        self.norm_ffn = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_mult * dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(ffn_mult * dim, dim),
        )
        self.edge_mlp = nn.Sequential(nn.Linear(3 * dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, h, e, edge_index):
        src, dst = edge_index
        x = self.norm_attn(h)
        h = h + self.attn(x, e, edge_index)
        h = h + self.ffn(self.norm_ffn(h))
        e = e + self.edge_mlp(torch.cat([x[src], x[dst], e], dim=-1))
        return h, e


class VirtualNode(nn.Module):
    def __init__(self, dim, dropout):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Dropout(dropout), nn.Linear(2 * dim, dim)
        )

    def forward(self, h, vn, batch, num_graphs):
        pooled = scatter_sum(h, batch, num_graphs) + vn
        vn = vn + self.mlp(pooled)
        return h + vn[batch], vn


def build_layers(dim, heads, depth, dropout):
    layers = nn.ModuleList()
    for _ in range(depth):
        layers.append(GraphTransformerLayer(dim, heads, dropout))
    return layers


class MolGraphTransformer(nn.Module):
    def __init__(self, dim=256, heads=8, depth=6, dropout=0.1, vn_every=2):
        super().__init__()
        self.atom_enc = FeatureEncoder(ATOM_FEATURE_DIMS, dim)
        self.bond_enc = FeatureEncoder(BOND_FEATURE_DIMS, dim)
        self.vn_init = nn.Parameter(torch.zeros(1, dim))
        self.layers = build_layers(dim, heads, depth, dropout)
        self.virtual = nn.ModuleDict(
            {str(i): VirtualNode(dim, dropout) for i in range(0, depth - 1, vn_every)}
        )
        self.final_norm = nn.LayerNorm(dim)
        self.graph_proj = nn.Linear(2 * dim, dim)
        self.head = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 2))

    def forward(self, batch):
        h = self.atom_enc(batch["x"])
        e = self.bond_enc(batch["edge_attr"])
        num_graphs = int(batch["num_graphs"])
        vn = self.vn_init.expand(num_graphs, -1)
        for i, layer in enumerate(self.layers):
            h, e = layer(h, e, batch["edge_index"])
            if str(i) in self.virtual:
                h, vn = self.virtual[str(i)](h, vn, batch["batch"], num_graphs)
        h = self.final_norm(h)
        pooled = torch.cat([global_mean_pool(h, batch["batch"], num_graphs), vn], dim=-1)
        graph_emb = self.graph_proj(pooled)
        pred = self.head(graph_emb)
        return MolOutput(mu=pred[:, 0], log_var=pred[:, 1].clamp(-10.0, 10.0), graph_emb=graph_emb)


def build_model(cfg):
    return MolGraphTransformer(
        dim=cfg.dim, heads=cfg.heads, depth=cfg.depth, dropout=cfg.dropout, vn_every=cfg.vn_every
    )


def gaussian_nll_loss(mu, log_var, target):
    var = log_var.exp()
    nll = 0.5 * (log_var.float() + (target - mu.float()) ** 2 / (var + 1e-8))
    return nll.mean()


# --------------------------------------------------------------------------- #
# training
# --------------------------------------------------------------------------- #
class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.device = torch.device("cuda")
        self.model = build_model(cfg)
        self.model.to(self.device)
        self.ema = copy.deepcopy(self.model).eval()
        self.ema.requires_grad_(False)
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.scaler = torch.amp.GradScaler("cuda")
        self.step = 0

    @torch.no_grad()
    def _update_ema(self, decay=0.999):
        for p_ema, p in zip(self.ema.parameters(), self.model.parameters()):
            p_ema.mul_(decay).add_(p.detach(), alpha=1.0 - decay)

    def _to_device(self, batch):
        return {
            k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in batch.items()
        }

    def train_step(self, batch):
        batch = self._to_device(batch)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = self.model(batch)
            nll = gaussian_nll_loss(out.mu, out.log_var, batch["y"])
            emb_std = torch.sqrt(out.graph_emb.var(dim=0) + 1e-8)  # expect: AMP004, AMP011
            var_reg = F.relu(1.0 - emb_std.float()).mean()
            loss = nll + self.cfg.var_weight * var_reg
            spread = out.mu.detach().std()  # expect: AMP004
        self.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._update_ema()
        self.step += 1
        return {"loss": loss.item(), "nll": nll.item(), "spread": spread.item()}

    @torch.no_grad()
    def evaluate(self, loader):
        self.ema.eval()
        abs_err, count, spreads = 0.0, 0, []
        for batch in loader:
            batch = self._to_device(batch)
            with torch.autocast("cuda", dtype=torch.float16):
                out = self.ema(batch)
            abs_err += (out.mu.float() - batch["y"]).abs().sum().item()
            count += batch["y"].numel()
            spreads.append(out.graph_emb.std(dim=0).mean().item())
        return {"mae": abs_err / max(count, 1), "emb_spread": sum(spreads) / max(len(spreads), 1)}

    def fit(self, train_loader, val_loader, epochs):
        best = float("inf")
        for epoch in range(epochs):
            for batch in train_loader:
                stats = self.train_step(batch)
                if self.step % self.cfg.log_every == 0:
                    print(f"ep {epoch} step {self.step} loss {stats['loss']:.4f} spread {stats['spread']:.3f}")
            metrics = self.evaluate(val_loader)
            print(f"ep {epoch} val mae {metrics['mae']:.4f}")
            if metrics["mae"] < best:
                best = metrics["mae"]
                torch.save({"model": self.model.state_dict(), "ema": self.ema.state_dict()}, self.cfg.ckpt)
        return best


def random_molecule_batch(num_graphs=32, atoms=18):
    sizes = torch.randint(atoms // 2, atoms, (num_graphs,))
    batch = torch.repeat_interleave(torch.arange(num_graphs), sizes)
    n = int(sizes.sum())
    x = torch.stack([torch.randint(0, d, (n,)) for d in ATOM_FEATURE_DIMS], dim=1)
    offsets = torch.cumsum(sizes, 0) - sizes
    src, dst = [], []
    for g in range(num_graphs):
        s = int(sizes[g])
        a = torch.arange(s - 1) + offsets[g]
        src += [a, a + 1]
        dst += [a + 1, a]
    edge_index = torch.stack([torch.cat(src), torch.cat(dst)])
    edge_attr = torch.stack([torch.randint(0, d, (edge_index.size(1),)) for d in BOND_FEATURE_DIMS], dim=1)
    return {
        "x": x, "edge_index": edge_index, "edge_attr": edge_attr, "batch": batch,
        "num_graphs": num_graphs, "y": torch.randn(num_graphs),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--vn-every", dest="vn_every", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.01)
    p.add_argument("--var-weight", dest="var_weight", type=float, default=0.04)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--log-every", dest="log_every", type=int, default=50)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ckpt", default="molgt.pt")
    cfg = p.parse_args()
    train_loader = [random_molecule_batch() for _ in range(200)]
    val_loader = [random_molecule_batch() for _ in range(20)]
    trainer = Trainer(cfg)
    trainer.fit(train_loader, val_loader, cfg.epochs)


if __name__ == "__main__":
    main()
