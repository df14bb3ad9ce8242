"""Graph transformer for molecular property prediction (regression + multi-task toxicity), dense batched graphs, fp16 AMP."""
import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

amp_ctx = functools.partial(torch.cuda.amp.autocast, dtype=torch.float16)  # expect: AMP009


class GraphAttentionLayer(nn.Module):
    def __init__(self, dim, heads, edge_dim, dropout=0.1):
        super().__init__()
        self.heads, self.dh = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.edge_bias = nn.Linear(edge_dim, heads)
        self.out = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, h, edge_feat, adj):
        B, N, D = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(B, N, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / self.dh**0.5
        scores = scores + self.edge_bias(edge_feat).permute(0, 3, 1, 2)
        scores = scores.masked_fill(~adj.unsqueeze(1), -1e9)  # expect: AMP007
        attn = self.drop(torch.softmax(scores, dim=-1))
        ctx = torch.einsum("bhij,bhjd->bhid", attn, v).transpose(1, 2).reshape(B, N, D)
        h = h + self.drop(self.out(ctx))
        return h + self.drop(self.ffn(self.norm2(h)))


class MolGraphTransformer(nn.Module):
    def __init__(self, atom_dim, edge_dim, dim=256, layers=6, heads=8, num_tox_tasks=12):
        super().__init__()
        self.atom_in = nn.Linear(atom_dim, dim)
        self.layers = nn.ModuleList([GraphAttentionLayer(dim, heads, edge_dim) for _ in range(layers)])
        self.out_proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, 1)
        self.reg_head = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, 1))
        self.tox_head = nn.Linear(2 * dim, num_tox_tasks)

    def forward(self, node_feat, edge_feat, adj, node_mask):
        h = self.atom_in(node_feat)
        for layer in self.layers:
            h = layer(h, edge_feat, adj)
        h = self.out_proj(h)
        gate = self.gate(h).squeeze(-1)
        gate = torch.where(node_mask, gate, torch.full_like(gate, -1e9))  # expect: AMP007
        w = torch.softmax(gate, dim=1)
        g_attn = (w.unsqueeze(-1) * h).sum(dim=1)
        g_mean = h.mean(dim=1)  # expect: AMP004
        g = torch.cat([g_attn, g_mean], dim=-1)
        return self.reg_head(g).squeeze(-1), self.tox_head(g)


def optimizer_step(scaler, optimizer, model, max_norm):
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)  # expect: AMP006
    optimizer.zero_grad(set_to_none=True)


def train_epoch(model, loader, criterion, optimizer, scaler, args):
    model.train()
    total = 0.0
    for batch in loader:
        node_feat, edge_feat, adj, node_mask, y_reg, y_tox, tox_mask = [t.cuda(non_blocking=True) for t in batch]
        node_feat, edge_feat = [t.half() for t in (node_feat, edge_feat)]  # expect: AMP001
        with amp_ctx():
            pred_reg, tox_logits = model(node_feat, edge_feat, adj.bool(), node_mask.bool())
            tox_prob = torch.sigmoid(tox_logits)
            loss_tox = F.binary_cross_entropy(tox_prob, y_tox, weight=tox_mask)  # expect: AMP003
        loss_reg = criterion(pred_reg, y_reg)  # expect: AMP002
        loss = loss_reg + args.tox_weight * loss_tox
        scaler.scale(loss).backward()
        optimizer_step(scaler, optimizer, model, args.clip)
        total += loss.item()
    return total / max(len(loader), 1)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    abs_err, n = 0.0, 0
    for batch in loader:
        node_feat, edge_feat, adj, node_mask, y_reg, _, _ = [t.cuda() for t in batch]
        with amp_ctx():
            pred_reg, _ = model(node_feat, edge_feat, adj.bool(), node_mask.bool())
        abs_err += (pred_reg.float() - y_reg).abs().sum().item()
        n += y_reg.numel()
    return abs_err / max(n, 1)


def export_onnx(model, example, path):
    m = copy.deepcopy(model).eval().half()
    torch.onnx.export(m, tuple(t.half() if t.is_floating_point() else t for t in example), path, opset_version=17)


def main(args, model, train_loader, val_loader):
    model = model.cuda()
    criterion = nn.SmoothL1Loss(beta=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    best = float("inf")
    for epoch in range(args.epochs):
        train_loss = train_epoch(model, train_loader, criterion, optimizer, scaler, args)
        mae = evaluate(model, val_loader)
        print(f"epoch {epoch} train {train_loss:.4f} val MAE {mae:.4f}")
        if mae < best:
            best = mae
            export_onnx(model, next(iter(val_loader))[:4], f"{args.out}/best.onnx")
    return best
