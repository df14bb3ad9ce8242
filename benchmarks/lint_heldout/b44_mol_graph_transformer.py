"""Graph transformer for multi-task molecular toxicity (Tox21-style).

Dense batching: molecules are padded to the largest graph in the batch
(node_mask marks real atoms). Runs on GPU with fp16 autocast, or on CPU with
bf16 autocast for quick experiments.
"""
import argparse
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score


class PaddedMolDataset(torch.utils.data.Dataset):
    """Pre-padded tensors: atoms, adj, edge_attr, hop_mask, node_mask, y, valid."""

    def __init__(self, path):
        self.data = torch.load(path)

    def __len__(self):
        return len(self.data["y"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.data.items()}


@dataclass
class MolOutput:
    logits: torch.Tensor
    graph_repr: torch.Tensor


class GraphNorm(nn.Module):
    """GraphNorm (Cai et al., 2021) over the atoms of each molecule."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.mean_scale = nn.Parameter(torch.ones(dim))

    def forward(self, x, node_mask):
        m = node_mask.unsqueeze(-1).to(x.dtype)
        x = x * m
        n = node_mask.sum(dim=1).clamp(min=1)[:, None, None]
        mean = x.mean(dim=1, keepdim=True) * (x.size(1) / n)  # expect: AMP004
        shifted = (x - self.mean_scale * mean) * m
        var = shifted.pow(2).sum(dim=1, keepdim=True) / n
        return self.weight * shifted / torch.sqrt(var + 1e-6) + self.bias


class MessagePassing(nn.Module):
    def __init__(self, dim, steps=3):
        super().__init__()
        self.msg = nn.Linear(dim, dim)
        self.upd = nn.Linear(2 * dim, dim)
        self.norms = nn.ModuleList([GraphNorm(dim) for _ in range(steps)])

    def forward(self, h, adj, node_mask):
        deg = adj.sum(-1, keepdim=True)
        for norm in self.norms:
            agg = torch.bmm(adj, self.msg(h)) / (deg + 1e-8)
            h = h + F.relu(norm(self.upd(torch.cat([h, agg], dim=-1)), node_mask))
        return h


class GraphAttention(nn.Module):
    def __init__(self, dim, heads, edge_dim, local=False):
        super().__init__()
        self.heads = heads
        self.local = local
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.edge_bias = nn.Linear(edge_dim, heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, h, edge_attr, hop_mask, node_mask):
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = scores + self.edge_bias(edge_attr).permute(0, 3, 1, 2)
        if self.local:
            scores = scores.masked_fill(hop_mask.unsqueeze(1) == 0, -1e9)  # expect: AMP007
        scores = scores.masked_fill(~node_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = scores.softmax(dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, d)
        return self.out(out)


class TransformerLayer(nn.Module):
    def __init__(self, dim, heads, edge_dim, local):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = GraphAttention(dim, heads, edge_dim, local=local)
        self.ln2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, h, edge_attr, hop_mask, node_mask):
        h = h + self.attn(self.ln1(h), edge_attr, hop_mask, node_mask)
        return h + self.ffn(self.ln2(h))


class StatsReadout(nn.Module):
    """Mean + spread pooling over atoms (a cheap stand-in for PNA aggregators)."""

    def __init__(self, dim, num_tasks):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Sequential(nn.Linear(2 * dim, dim), nn.GELU(), nn.Linear(dim, num_tasks))

    def forward(self, h, node_mask):
        m = node_mask.unsqueeze(-1)
        z = self.proj(h).masked_fill(~m, 0.0)
        n = m.sum(dim=1).clamp(min=1)
        mu = z.sum(dim=1) / n
        spread = z.std(dim=1, unbiased=False)  # expect: AMP004
        g = torch.cat([mu, spread], dim=-1)
        return self.head(g), g


class MolGraphTransformer(nn.Module):
    def __init__(self, atom_dim, edge_dim, num_tasks, dim=256, heads=8, depth=6):
        super().__init__()
        self.atom_in = nn.Linear(atom_dim, dim)
        self.mpnn = MessagePassing(dim)
        self.layers = nn.ModuleList(
            [TransformerLayer(dim, heads, edge_dim, local=(i % 2 == 0)) for i in range(depth)]
        )
        self.readout = StatsReadout(dim, num_tasks)

    def forward(self, atoms, adj, edge_attr, hop_mask, node_mask):
        h = self.mpnn(self.atom_in(atoms), adj, node_mask)
        for layer in self.layers:
            h = layer(h, edge_attr, hop_mask, node_mask)
        logits, g = self.readout(h, node_mask)
        return MolOutput(logits=logits, graph_repr=g)


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype):
    model.eval()
    ys, ps, ws = [], [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device_type=device.type, dtype=amp_dtype):
            out = model(batch["atoms"], batch["adj"], batch["edge_attr"], batch["hop_mask"], batch["node_mask"])
        ps.append(torch.sigmoid(out.logits).float().cpu().numpy())
        ys.append(batch["y"].cpu().numpy())
        ws.append(batch["valid"].cpu().numpy())
    y, p, w = np.concatenate(ys), np.concatenate(ps), np.concatenate(ws)
    aucs = [roc_auc_score(y[w[:, t] > 0, t], p[w[:, t] > 0, t]) for t in range(y.shape[1]) if w[:, t].sum() > 10]
    model.train()
    return float(np.mean(aucs))


def train(args, train_loader, val_loader):
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if use_cuda else "cpu")
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    model = MolGraphTransformer(args.atom_dim, args.edge_dim, args.num_tasks, dim=args.dim).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scaler = torch.amp.GradScaler(device.type, enabled=(amp_dtype == torch.float16))
    criterion = nn.BCELoss(reduction="none")
    best_auc = 0.0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device_type=device.type, dtype=amp_dtype):
                out = model(batch["atoms"], batch["adj"], batch["edge_attr"], batch["hop_mask"], batch["node_mask"])
                probs = torch.sigmoid(out.logits)
                per_task = criterion(probs, batch["y"].clamp(min=0.0))  # expect: AMP003
                loss = (per_task * batch["valid"]).sum() / batch["valid"].sum().clamp(min=1.0)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
        auc = evaluate(model, val_loader, device, amp_dtype)
        if auc > best_auc:
            best_auc = auc
            torch.save({"model": model.state_dict(), "epoch": epoch}, args.ckpt)
        print(f"epoch {epoch:3d} loss {loss.item():.4f} val ROC-AUC {auc:.4f} (best {best_auc:.4f})")
    return best_auc


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--atom_dim", type=int, default=74)
    p.add_argument("--edge_dim", type=int, default=12)
    p.add_argument("--num_tasks", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--ckpt", default="molgt_best.pt")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--data", default="tox21_dense.pt")
    cli_args = p.parse_args()
    full = PaddedMolDataset(cli_args.data)
    n_val = len(full) // 10
    tr, va = torch.utils.data.random_split(full, [len(full) - n_val, n_val])
    train(cli_args, torch.utils.data.DataLoader(tr, batch_size=64, shuffle=True), torch.utils.data.DataLoader(va, batch_size=128))
